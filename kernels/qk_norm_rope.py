"""Attention's per-token prologue in one Triton launch: q/k RMSNorm per head, rotary embedding on
the first rotary_dim channels, and the new K/V written into their KV-pool rows.

Twin: the torch path of services/worker/models/attention.py (norms.py, rotary.py, and
kernels/paged_attention_reference.write_kv), which is also the CPU path. In torch this is ~16
kernels per layer (two norms, neg/cat/mul/mul/add/cat per rotary application, two index_copy_);
at decode each moves a few KiB, so the launches are the cost.

One program handles one (token, head) pair; heads [0, heads) are query heads (written to a
contiguous [T, heads, head_dim] output for the attention kernel), heads [heads, heads + kv_heads)
are key heads, written with their value head straight to pool row slot_mapping[t]. The rotary
partner of channel i (i + half or i - half, the rotate_half convention) is read again from memory
and normalised with the same row statistic rather than shuffled in registers.

Rounding follows the twin in the model dtype: the normalised row as the norm rounds it; then
rot * cos and rotate_half(rot) * sin each rounded, and their sum rounded. cos/sin are the step's
tables (already rounded to the model dtype, as the reference rounds them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normed(x, w, inv_rms, out_ty, ZERO_CENTERED: tl.constexpr):
    if ZERO_CENTERED:
        return (x * inv_rms * (1.0 + w)).to(out_ty).to(tl.float32)
    return (w * (x * inv_rms).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)


@triton.jit
def _qk_norm_rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    heads, D, ROT, HALF,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, cache_row, eps,
    ZERO_CENTERED: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_q = h < heads
    kh = h - heads
    if is_q:
        src = q_ptr + t * stride_qt + h * stride_qh
        w_ptr = qw_ptr
    else:
        src = k_ptr + t * stride_kt + kh * stride_kh
        w_ptr = kw_ptr
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    in_rot = offs < ROT
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    partner = tl.where(in_rot, partner, offs)
    x = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    out_ty = q_out_ptr.dtype.element_ty
    y = _normed(x, w, inv_rms, out_ty, ZERO_CENTERED)
    yp = _normed(xp, wp, inv_rms, out_ty, ZERO_CENTERED)
    cos = tl.load(cos_ptr + t * stride_ct + offs, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_ct + offs, mask=in_rot, other=0.0).to(tl.float32)
    rotated_half = tl.where(offs < HALF, -yp, yp)
    turned = ((y * cos).to(out_ty).to(tl.float32) + (rotated_half * sin).to(out_ty).to(tl.float32)).to(out_ty)
    out = tl.where(in_rot, turned, y.to(out_ty))
    if is_q:
        tl.store(q_out_ptr + (t * heads + h) * D + offs, out, mask=ok)
    else:
        row = tl.load(slot_ptr + t).to(tl.int64) * cache_row + kh * D
        tl.store(k_cache_ptr + row + offs, out.to(k_cache_ptr.dtype.element_ty), mask=ok)
        v = tl.load(v_ptr + t * stride_vt + kh * stride_vh + offs, mask=ok, other=0.0)
        tl.store(v_cache_ptr + row + offs, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def qk_norm_rope_kv_triton(q, k, v, q_weight, k_weight, eps: float, zero_centered: bool, cos, sin, rotary_dim: int,
                           slot_mapping, k_cache, v_cache, q_out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """q [T, heads, D], k and v [T, kv_heads, D] (views with unit stride along D); cos/sin
    [T, rotary_dim]; slot_mapping int [T]; caches [pages, page_size, kv_heads, D] (contiguous).
    Writes normed+rotated k and v to the caches; returns normed+rotated q, contiguous."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    if min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qk_norm_rope_kv_triton needs unit stride along head_dim and along the rotary tables")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[-2:] != (kv_heads, d):
        raise ValueError(f"the caches must be contiguous [pages, page_size, {kv_heads}, {d}]")
    if rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {d}")
    if q_out is None:
        q_out = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    if t:
        _qk_norm_rope_kv_kernel[(t, heads + kv_heads)](
            q, k, v, q_weight, k_weight, cos, sin, slot_mapping, q_out, k_cache, v_cache,
            heads, d, rotary_dim, rotary_dim // 2,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            kv_heads * d, eps,
            ZERO_CENTERED=zero_centered, BLOCK_D=triton.next_power_of_2(d),
        )  # fmt: skip
    return q_out
