"""Attention's per-token prologue in one Triton launch: q/k RMSNorm per head, rotary embedding on
the first rotary_dim channels, and the new K/V written into their KV-pool rows.

Twin: the torch path of services/worker/layers/attention.py (norms.py, rotary.py, and
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

An fp8 pool (KV_FP8: caches of e4m3, k_scale / v_scale [pages, page_size, kv_heads] float32) takes each K
and V row quantized as the twin's `quantize_kv_rows` does it: the row in the model dtype, its amax / 448
the scale, the values divided by it (div_rn: IEEE division, as torch divides), clamped to +-448 and rounded
to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.paged_attention_reference import KV_AMAX_FLOOR, KV_FP8_MAX

_FP8_MAX = tl.constexpr(KV_FP8_MAX)
_AMAX_FLOOR = tl.constexpr(KV_AMAX_FLOOR)


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to nearest even on e4m3's grid, still float32, so the cast that follows
    is exact: compiled or interpreted (whose float8 cast rounds half up and drops the carry into the
    exponent), the bytes are torch's. Normal e4m3 (|x| >= 2^-6) keeps 3 mantissa bits, rounded on the bits
    with the carry into the exponent; subnormal e4m3 is the multiples of 2^-9, which 1.5 x 2^14 (whose ulp is
    2^-9) rounds the magnitude to when added and taken away."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    magnitude = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = tl.where(bits < 0, -magnitude, magnitude)  # the sign bit kept, -0 included: torch's bytes
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _store_row(cache_ptr, scale_ptr, row, scale_row, offs, ok, x, KV_FP8: tl.constexpr):
    """One K or V row (x, the model dtype) at its cache row: as it is, or with KV_FP8 quantized beside its scale."""
    if KV_FP8:
        xf = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.where(ok, tl.abs(xf), 0.0), axis=0), _AMAX_FLOOR)
        scale = tl.math.div_rn(amax, tl.full([], _FP8_MAX, tl.float32))
        values = _round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(xf, scale), -_FP8_MAX), _FP8_MAX))
        tl.store(cache_ptr + row + offs, values.to(cache_ptr.dtype.element_ty), mask=ok)
        tl.store(scale_ptr + scale_row, scale)
    else:
        tl.store(cache_ptr + row + offs, x.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _normed(x, w, inv_rms, out_ty, ZERO_CENTERED: tl.constexpr):
    if ZERO_CENTERED:
        return (x * inv_rms * (1.0 + w)).to(out_ty).to(tl.float32)
    return (w * (x * inv_rms).to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)


@triton.jit
def _qk_norm_rope_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    ks_ptr,
    vs_ptr,
    heads,
    D,
    ROT,
    HALF,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    cache_row,
    eps,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
):
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
        slot = tl.load(slot_ptr + t).to(tl.int64)
        row = slot * cache_row + kh * D
        scale_row = slot * (cache_row // D) + kh  # the scales are [rows, kv_heads]: cache_row = kv_heads x D
        _store_row(k_cache_ptr, ks_ptr, row, scale_row, offs, ok, out, KV_FP8)
        v = tl.load(v_ptr + t * stride_vt + kh * stride_vh + offs, mask=ok, other=0.0)
        _store_row(v_cache_ptr, vs_ptr, row, scale_row, offs, ok, v, KV_FP8)


def qk_norm_rope_kv_triton(
    q,
    k,
    v,
    q_weight,
    k_weight,
    eps: float,
    zero_centered: bool,
    cos,
    sin,
    rotary_dim: int,
    slot_mapping,
    k_cache,
    v_cache,
    q_out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, heads, D], k and v [T, kv_heads, D] (views with unit stride along D); cos/sin
    [T, rotary_dim]; slot_mapping int [T]; caches [pages, page_size, kv_heads, D] (contiguous), with
    k_scale / v_scale [pages, page_size, kv_heads] (contiguous) for an fp8 pool.
    Writes normed+rotated k and v to the caches; returns normed+rotated q, contiguous."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    if min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("qk_norm_rope_kv_triton needs unit stride along head_dim and along the rotary tables")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[-2:] != (kv_heads, d):
        raise ValueError(f"the caches must be contiguous [pages, page_size, {kv_heads}, {d}]")
    fp8 = k_scale is not None
    if fp8 and (
        v_scale is None
        or not (k_scale.is_contiguous() and v_scale.is_contiguous())
        or k_scale.shape != k_cache.shape[:-1]
        or v_scale.shape != k_scale.shape
    ):
        raise ValueError(f"an fp8 pool's scales must both be contiguous [pages, page_size, {kv_heads}]")
    if rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {d}")
    if q_out is None:
        q_out = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    if t:
        _qk_norm_rope_kv_kernel[(t, heads + kv_heads)](
            q,
            k,
            v,
            q_weight,
            k_weight,
            cos,
            sin,
            slot_mapping,
            q_out,
            k_cache,
            v_cache,
            k_scale if fp8 else k_cache,
            v_scale if fp8 else v_cache,
            heads,
            d,
            rotary_dim,
            rotary_dim // 2,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            cos.stride(0),
            kv_heads * d,
            eps,
            ZERO_CENTERED=zero_centered,
            BLOCK_D=triton.next_power_of_2(d),
            KV_FP8=fp8,
        )
    return q_out
