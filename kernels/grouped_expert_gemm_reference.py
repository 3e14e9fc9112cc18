"""Reference twin of the grouped expert GEMM: every token through its top-k experts, by slot.

`w13[s]` holds expert s's gate rows then up rows ([2I, H]); `w2[s]` its down projection ([H, I]).
`topk_slots` are slot indices (the caller has mapped (layer, expert) to slots). Computed in the
weights' dtype; each (token, k) pair's weighted output is kept in float32 and the k of a token
are summed in k order, so the result does not depend on which slots the experts occupy (an
offloading cache and an all-resident store give the same bits). A slot of -1 skips its pair,
which lets a caller compute a layer's experts in groups (e.g. while later groups are copied).
This is the reference for the Triton kernel (`grouped_expert_gemm.py`) and the CPU path; quantized
slots (kernels/quantized_experts.py) are dequantized and computed the same way, the reference for
their kernels (quantized_expert_gemm.py, quantized_expert_gemv.py). Slots whose experts have biases or
another activation come as EpilogueFamily views (expert_epilogue.py): the biases join each product in
the weights' dtype before the activation and before the routing weight."""

from __future__ import annotations

import torch

from ferry.kernels.expert_epilogue import SILU_AND_MUL, EpilogueFamily, family_parts
from ferry.kernels.quantized_experts import QuantizedFamily, dequantize_slot


def grouped_expert_rows_reference(
    x: torch.Tensor,  # [T, H]
    topk_slots: torch.Tensor,  # int [T, k]; -1: skip this pair
    topk_weights: torch.Tensor,  # float [T, k]
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
    rows: torch.Tensor,  # [T, k, H] in float32 (or x's dtype: each row rounded once), written where topk_slots >= 0
) -> None:
    if not isinstance(w13, torch.Tensor | EpilogueFamily):  # quantized slots: dequantized, then computed here
        return quantized_expert_rows_reference(x, topk_slots, topk_weights, w13, w2, rows)
    w13, b13, activation = family_parts(w13)
    w2, b2, _ = family_parts(w2)
    for slot in torch.unique(topk_slots).tolist():
        if slot < 0:
            continue
        token_idx, which = torch.nonzero(topk_slots == slot, as_tuple=True)
        h = x[token_idx] @ w13[slot].t()
        if b13 is not None:
            h = h + b13[slot]
        gate, up = h.chunk(2, dim=-1)
        y = activation(gate, up) @ w2[slot].t()
        if b2 is not None:
            y = y + b2[slot]
        # a row buffer in x's dtype (a long step's) takes the float32 row rounded once, to nearest even
        rows[token_idx, which] = (y.float() * topk_weights[token_idx, which, None].float()).to(rows.dtype)


def grouped_expert_forward_reference(
    x: torch.Tensor,  # [T, H]
    topk_slots: torch.Tensor,  # int [T, k]
    topk_weights: torch.Tensor,  # float [T, k]
    w13: torch.Tensor,  # [S, 2I, H]
    w2: torch.Tensor,  # [S, H, I]
) -> torch.Tensor:
    rows = torch.zeros(x.shape[0], topk_slots.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    grouped_expert_rows_reference(x, topk_slots, topk_weights, w13, w2, rows)
    return rows.sum(dim=1).to(x.dtype)


def quantized_expert_rows_reference(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: QuantizedFamily,
    w2: QuantizedFamily,
    rows: torch.Tensor,
) -> None:
    """`grouped_expert_rows_reference` for quantized slots: each slot a pair routes to is
    dequantized to x's dtype, then computed exactly as plain slots are (same rounding order), with its
    biases (rounded to x's dtype) and activation where the family has them."""
    for slot in torch.unique(topk_slots).tolist():
        if slot < 0:
            continue
        g13 = dequantize_slot(w13, slot, x.dtype).unsqueeze(0)
        g2 = dequantize_slot(w2, slot, x.dtype).unsqueeze(0)
        if w13.bias is not None or w13.activation != SILU_AND_MUL:  # biases rounded to x's dtype, as added
            b13 = None if w13.bias is None else w13.bias[slot : slot + 1].to(x.dtype)
            b2 = None if w2.bias is None else w2.bias[slot : slot + 1].to(x.dtype)
            g13, g2 = EpilogueFamily(g13, b13, w13.activation), EpilogueFamily(g2, b2)
        one = torch.where(topk_slots == slot, 0, -1)
        grouped_expert_rows_reference(x, one, topk_weights, g13, g2, rows)
