"""Triton paged attention: one program per (new token, query head), an online softmax over the
token's visible keys read page by page through its request's page table.

It serves decode (one new token per request) and, less efficiently, prefill chunks (every new
token is its own program). Scores use elementwise products and sums rather than `tl.dot`, so
there is no minimum block shape and no bf16-dot issue under TRITON_INTERPRET=1; accumulation is
in float32. Twin: `paged_attention_reference`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, page_table_ptr, token_req_ptr, positions_ptr,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    scale,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    num_keys = tl.load(positions_ptr + t).to(tl.int64) + 1  # causal: keys 0..own position
    kv_head = h // GROUP

    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=d_mask, other=0.0).to(tl.float32)

    m_i = -float("inf")  # running max and normaliser: fp32 scalars once the loop has run
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, num_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < num_keys
        # masked lanes read the sentinel page 0, never another request's page
        page = tl.load(page_table_ptr + req * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        within = (n % PAGE_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + page[:, None] * stride_kp + within[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(n_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            v_ptr + page[:, None] * stride_vp + within[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def token_requests(query_start: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request index of every new token, computed on the device without a host sync."""
    tokens = torch.arange(num_tokens, device=query_start.device, dtype=query_start.dtype)
    return torch.searchsorted(query_start[1:].contiguous(), tokens, right=True)


def paged_attention_triton(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # int32 [R, max_pages]
    query_start: torch.Tensor,  # int32 [R + 1]
    positions: torch.Tensor,  # int64 [T]
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int = 32,
    token_request: torch.Tensor | None = None,  # int [T]: each token's request, if the caller has it
) -> torch.Tensor:
    num_tokens, heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_attention_triton needs head_dim contiguous in q and the caches")
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    page_table = page_table.contiguous()
    # ForwardBatch carries it (made on the host with the rest of the step): two launches per
    # layer fewer than deriving it here
    token_req = token_requests(query_start, num_tokens) if token_request is None else token_request
    _paged_attention_kernel[(num_tokens, heads)](
        q, k_cache, v_cache, out, page_table, token_req, positions,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        scale,
        PAGE_SIZE=page_size,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
    )  # fmt: skip
    return out
