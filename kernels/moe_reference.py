"""Reference twin of the grouped expert GEMM: every token through its top-k experts, by slot.

`w13[s]` holds expert s's gate rows then up rows ([2I, H]); `w2[s]` its down projection ([H, I]).
`topk_slots` are slot indices (the caller has mapped (layer, expert) to slots). Computed in the
weights' dtype with float32 accumulation of the weighted sum, one slot at a time, as the
reference for the Triton kernel and the CPU path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_expert_forward_reference(
    x: torch.Tensor,  # [T, H]
    topk_slots: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # float [T, k]
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
) -> torch.Tensor:
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat_slots = topk_slots.reshape(-1)
    for slot in torch.unique(flat_slots).tolist():
        token_idx, which = torch.nonzero(topk_slots == slot, as_tuple=True)
        h = x[token_idx] @ w13[slot].t()
        gate, up = h.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[slot].t()
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, which, None].float())
    return out.to(x.dtype)
