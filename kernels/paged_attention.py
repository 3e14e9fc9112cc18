"""Paged attention dispatch: Triton on CUDA (the decode kernel when every request brings one
token, the blocked prefill kernel otherwise), the reference twin elsewhere."""

from __future__ import annotations

import torch

from ferry.kernels.dispatch import use_triton
from ferry.kernels.paged_attention_reference import paged_attention_reference, write_kv

__all__ = ["paged_attention", "write_kv"]


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # int32 [R, max_pages]
    query_start: torch.Tensor,  # int32 [R + 1]
    positions: torch.Tensor,  # int64 [T]
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
    token_request: torch.Tensor | None = None,  # int [T]: each token's request (decode kernel), optional
) -> torch.Tensor:
    if not use_triton(q):
        return paged_attention_reference(q, k_cache, v_cache, page_table, query_lens, context_lens, scale)
    from ferry.kernels import paged_attention_triton as triton_kernels

    if q.shape[0] == len(query_lens):  # one new token per request: decode
        return triton_kernels.paged_attention_decode_triton(q, k_cache, v_cache, page_table, query_start, positions,
                                                            scale, token_request=token_request)  # fmt: skip
    return triton_kernels.paged_attention_prefill_triton(q, k_cache, v_cache, page_table, query_start, positions,
                                                         query_lens, scale)  # fmt: skip
