"""Triton paged attention for prompt chunks: one program per (block of a request's new tokens,
query head), tensor-core dots over key blocks read through the request's page table.

Every query row attends to keys 0..its own position (context + the chunk's earlier tokens and
itself); rows of a block past the request's last token compute but are not stored. The first key
block always holds key 0, visible to every row, so the running maximum is finite from the first
block on and masked blocks contribute exactly zero. Twin: `paged_attention_reference`.

Under TRITON_INTERPRET=1 the dots run in float32 (the interpreter's bf16 dot is wrong); compiled,
they take the cache dtype with float32 accumulation."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, page_table_ptr, positions_ptr, query_start_ptr,
    block_req_ptr, block_first_ptr,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    scale,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    h = tl.program_id(1)
    req = tl.load(block_req_ptr + blk).to(tl.int64)
    first = tl.load(block_first_ptr + blk).to(tl.int64)
    end = tl.load(query_start_ptr + req + 1).to(tl.int64)
    kv_head = h // GROUP

    m = first + tl.arange(0, BLOCK_M)
    m_mask = m < end
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    pos_m = tl.load(positions_ptr + m, mask=m_mask, other=0)
    q_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + m[:, None] * stride_qt + h * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    last = tl.minimum(end, first + BLOCK_M) - 1
    num_keys = tl.load(positions_ptr + last).to(tl.int64) + 1

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, num_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < num_keys
        page = tl.load(page_table_ptr + req * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        within = (n % PAGE_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kp + within[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        v = tl.load(v_ptr + page[:, None] * stride_vp + within[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)  # fmt: skip
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = (n[None, :] <= pos_m[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + m[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])  # fmt: skip


def query_blocks(query_lens: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """(request, first token row) of every block of `block_m` new tokens; empty requests have none."""
    reqs, firsts, start = [], [], 0
    for r, qlen in enumerate(query_lens):
        for offset in range(0, qlen, block_m):
            reqs.append(r)
            firsts.append(start + offset)
        start += qlen
    return reqs, firsts


def paged_prefill_triton(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # int32 [R, max_pages]
    query_start: torch.Tensor,  # int32 [R + 1]
    positions: torch.Tensor,  # int64 [T]
    query_lens: list[int],
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    num_tokens, heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_prefill_triton needs head_dim contiguous in q and the caches")
    if out is None:
        out = torch.empty_like(q)
    reqs, firsts = query_blocks(query_lens, block_m)
    if not reqs:
        return out
    block_req = torch.tensor(reqs, dtype=torch.int32).to(q.device, non_blocking=True)
    block_first = torch.tensor(firsts, dtype=torch.int32).to(q.device, non_blocking=True)
    page_table = page_table.contiguous()
    _paged_prefill_kernel[(len(reqs), heads)](
        q, k_cache, v_cache, out, page_table, positions, query_start, block_req, block_first,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        scale,
        PAGE_SIZE=page_size,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        FP32_DOT=os.environ.get("TRITON_INTERPRET") == "1" or q.dtype == torch.float32,
    )  # fmt: skip
    return out
