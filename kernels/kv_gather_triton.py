"""One request's K or V gathered from an fp8 KV pool's pages and dequantized, in one Triton launch: what
FlashAttention reads for a long prefill (kernels/paged_attention_flash.py) when the pool holds e4m3 values
and a float32 scale per (token, kv head) row (--kv-cache-dtype fp8).

Twin: `gather_request_kv` with `scales` (kernels/paged_attention_reference.py): value x scale in float32,
rounded once to the output dtype. Fused so the gather needs no fp8 copy of the context and no float32
product beside the output buffer: its bytes are the gather buffers' own, priced as for a pool of the model
dtype (services/worker/workspace_profile.gathered_context_bytes). One program per (block of positions, kv
head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.shared.units import ceil_div

BLOCK_T = 16  # positions a program dequantizes


@triton.jit
def _gather_dequantize_kernel(
    cache_ptr,
    scale_ptr,
    pages_ptr,
    out_ptr,
    length,
    stride_cp,
    stride_cs,
    stride_ch,
    stride_sp,
    stride_ss,
    stride_sh,
    PAGE_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    n_mask = n < length
    d = tl.arange(0, BLOCK_D)
    mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
    page = tl.load(pages_ptr + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    within = n % PAGE_SIZE
    x = tl.load(
        cache_ptr + page[:, None] * stride_cp + within[:, None] * stride_cs + h * stride_ch + d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    s = tl.load(scale_ptr + page * stride_sp + within * stride_ss + h * stride_sh, mask=n_mask, other=0.0)
    tl.store(
        out_ptr + (n[:, None] * KV_HEADS + h) * HEAD_DIM + d[None, :],
        (x * s[:, None]).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def gather_dequantize_kv_triton(
    cache: torch.Tensor,
    scales: torch.Tensor,
    pages: torch.Tensor,
    length: int,
    dtype: torch.dtype,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """cache e4m3 [pages, page_size, kv_heads, head_dim] (head_dim contiguous), scales float32 [pages,
    page_size, kv_heads], pages int [>= ceil(length / page_size)]: the first `length` positions,
    [length, kv_heads, head_dim] of `dtype`, in `into`'s first pages (contiguous [n, page_size, kv_heads,
    head_dim] of `dtype`) where it has room, else in a new tensor."""
    page_size, kv_heads, head_dim = cache.shape[1:]
    if cache.stride(-1) != 1:
        raise ValueError("gather_dequantize_kv_triton needs head_dim contiguous in the cache")
    needed = ceil_div(length, page_size)
    if into is not None and needed <= into.shape[0] and into.dtype == dtype and into.is_contiguous():
        out = into[:needed].view(-1, kv_heads, head_dim)[:length]
    else:
        out = torch.empty(length, kv_heads, head_dim, dtype=dtype, device=cache.device)
    if length:
        _gather_dequantize_kernel[(ceil_div(length, BLOCK_T), kv_heads)](
            cache,
            scales,
            pages,
            out,
            length,
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            scales.stride(0),
            scales.stride(1),
            scales.stride(2),
            PAGE_SIZE=page_size,
            KV_HEADS=kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_T=BLOCK_T,
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out
