"""Gated delta rule over a batch of requests, each continuing from its linear-state slot.

CUDA with bf16/fp16 activations: fla-core's Triton kernels over the whole varlen batch
(`cu_seqlens`), imported only there because fla needs a GPU (and its chunked kernel refuses
float32). Otherwise: the float32 reference twins, request by request (chunked for prompts,
recurrent for single decode tokens), on whatever device the tensors are. Either way the states
of the batch's slots are read before and written after, in place, in the float32 pool."""

from __future__ import annotations

import torch

from ferry.kernels.gated_delta_rule_reference import gated_delta_rule_chunked, gated_delta_rule_recurrent


def gated_delta_rule_varlen(
    q: torch.Tensor,  # [T, k_heads, k_dim], requests one after another
    k: torch.Tensor,  # [T, k_heads, k_dim]
    v: torch.Tensor,  # [T, v_heads, v_dim]
    g: torch.Tensor,  # [T, v_heads] float32
    beta: torch.Tensor,  # [T, v_heads]
    states: torch.Tensor,  # [slots, v_heads, k_dim, v_dim] float32, updated in place
    state_slots: torch.Tensor,  # int64 [R]
    query_start: torch.Tensor,  # int32 [R + 1]
    query_lens: list[int],
) -> torch.Tensor:
    """Outputs [T, v_heads, v_dim] in v's dtype."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return _fla_varlen(q, k, v, g, beta, states, state_slots, query_start, query_lens)
    out = torch.empty_like(v)
    start = 0
    for slot, qlen in zip(state_slots.tolist(), query_lens):
        rows = slice(start, start + qlen)
        rule = gated_delta_rule_recurrent if qlen == 1 else gated_delta_rule_chunked
        o, final = rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot])
        out[rows] = o.to(v.dtype)
        states[slot] = final
        start += qlen
    return out


def _fla_varlen(q, k, v, g, beta, states, state_slots, query_start, query_lens):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    v_heads, k_heads = v.shape[1], k.shape[1]
    if v_heads != k_heads:  # grouped heads: give every value head its q/k head
        q = q.repeat_interleave(v_heads // k_heads, dim=1)
        k = k.repeat_interleave(v_heads // k_heads, dim=1)
    initial = states[state_slots]  # [R, v_heads, k_dim, v_dim]
    all_decode = max(query_lens) == 1
    rule = fused_recurrent_gated_delta_rule if all_decode else chunk_gated_delta_rule
    # by keyword: fla's positional order differs between the two functions
    out, final = rule(
        q=q[None].contiguous(),
        k=k[None].contiguous(),
        v=v[None].contiguous(),
        g=g[None].float().contiguous(),
        beta=beta[None].contiguous(),
        initial_state=initial.contiguous(),
        output_final_state=True,
        cu_seqlens=query_start.long(),
        use_qk_l2norm_in_kernel=True,
    )
    states[state_slots] = final.float()
    return out[0].to(v.dtype)
