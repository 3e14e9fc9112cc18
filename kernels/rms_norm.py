"""RMSNorm in one Triton launch, optionally fused with the residual add before it.

Twin: kernels/rms_norm_reference.py (the CPU path of services/worker/layers/norms.py). In plain torch
one RMSNorm is ~8 kernels (upcast, square, mean, add eps, rsqrt, scale, downcast, weight), and a
decode step runs four per layer (input, post-attention, per-head q and k) plus the residual adds:
at one token those launches, not the bytes, are the step's cost. Here one program normalises one
row in float32 registers.

Rounding follows the twin: the residual sum is rounded to the model dtype (as `residual + x` is);
the normalised row is rounded to the model dtype before the weight multiplies it (qwen3_moe's
`weight * x_hat.to(dtype)`), or multiplied by (1 + w) in float32 and rounded last for the
zero-centred variant (qwen3_next, qwen3_5_moe). The gated variant (Gated DeltaNet's output norm)
multiplies the plain one's model-dtype result by SiLU(gate) in float32 and rounds last.

With `rows` (an unsummed MoE output, kernels/expert_rows_sum.py: float32 [T, k, D]) in place of x,
the kernel first adds each token's k rows in k order in float32 and rounds the sum to the model
dtype, exactly as `sum_rows` would have, so the MoE layer's sum costs no launch of its own.

Rows may come from a strided view, e.g. the per-head queries split out of a gated q projection
([T, heads, head_dim] with a token stride of heads * 2 * head_dim): the input is addressed as
(outer, inner) rows with two strides and the output is always contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.expert_rows_sum import ExpertRows


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    out_ptr,
    res_out_ptr,
    w_ptr,
    gate_ptr,
    D,
    inner,
    stride_outer,
    stride_inner,
    gate_stride_outer,
    gate_stride_inner,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    GATED: tl.constexpr,
    ROWS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    out_ty = out_ptr.dtype.element_ty
    if ROWS:  # x_ptr: float32 [T, TOP_K, D], summed in k order and rounded as sum_rows does
        # unrolled: the k loads are independent and go out together (a runtime loop waited for
        # each in turn: 5.6 µs a one-token call against 1.8 without rows)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(x_ptr + (row * TOP_K + j) * D + offs, mask=ok, other=0.0)
        x = acc.to(out_ty)
    else:
        src = (row // inner) * stride_outer + (row % inner) * stride_inner
        x = tl.load(x_ptr + src + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * D + offs, mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(out_ty)
        tl.store(res_out_ptr + row * D + offs, x, mask=ok)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / D
    x_hat = xf * tl.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = x_hat * (1.0 + w)
    else:
        y = w * x_hat.to(out_ty).to(tl.float32)
    if GATED:  # the model-dtype norm output times SiLU(gate) computed in float32
        g_src = (row // inner) * gate_stride_outer + (row % inner) * gate_stride_inner
        z = tl.load(gate_ptr + g_src + offs, mask=ok, other=0.0).to(tl.float32)
        y = y.to(out_ty).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + row * D + offs, y.to(out_ty), mask=ok)


def rms_norm_triton(
    x: torch.Tensor | ExpertRows,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
):
    """norm(x) as a contiguous tensor of x's shape; with `residual` (contiguous, x's shape):
    (norm(residual + x), residual + x). x: [R, D] or [T, heads, D], unit stride along D, or
    `ExpertRows` (with a residual: the rows' sum is x).
    `out` / `residual_out`: where to write (tests poison them), new tensors by default.
    `gate` (x's shape, unit stride along D): the gated variant, plain norm only, no residual."""
    if isinstance(x, ExpertRows):
        if gate is not None:
            raise ValueError("the gated norm takes a tensor, not a MoE block's unsummed rows")
        return _rms_norm_rows(x, weight, eps, zero_centered, residual, out, residual_out)
    d = x.shape[-1]
    if x.stride(-1) != 1 or x.dim() not in (2, 3) or weight.shape != (d,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm_triton: x {tuple(x.shape)} stride {x.stride()}, weight {tuple(weight.shape)}")
    inner, stride_outer, stride_inner = _row_strides(x)
    gate_strides = (0, 0)
    if gate is not None:
        if gate.shape != x.shape or gate.stride(-1) != 1 or zero_centered or residual is not None:
            raise ValueError("the gate must have x's shape and unit stride along D (plain norm, no residual)")
        gate_strides = _row_strides(gate)[1:]
    rows = x.numel() // d
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    res_out = None
    if residual is not None:
        if residual.shape != x.shape or not residual.is_contiguous() or residual.dtype != x.dtype:
            raise ValueError("the residual must be a contiguous tensor of x's shape and dtype")
        res_out = torch.empty_like(residual) if residual_out is None else residual_out
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else out,
            out,
            res_out if res_out is not None else out,
            weight,
            gate if gate is not None else x,
            d,
            inner,
            stride_outer,
            stride_inner,
            *gate_strides,
            eps,
            HAS_RESIDUAL=residual is not None,
            ZERO_CENTERED=zero_centered,
            GATED=gate is not None,
            ROWS=False,
            TOP_K=1,
            BLOCK_D=triton.next_power_of_2(d),
        )
    return out if residual is None else (out, res_out)


def _rms_norm_rows(x: ExpertRows, weight, eps, zero_centered, residual, out, residual_out):
    """`rms_norm_triton` of a residual plus an unsummed MoE output."""
    rows = x.rows
    t, top_k, d = rows.shape
    if rows.dtype != torch.float32 or not rows.is_contiguous() or weight.shape != (d,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm_triton: rows {tuple(rows.shape)} {rows.dtype}, weight {tuple(weight.shape)}")
    if residual is None or tuple(residual.shape) != (t, d) or not residual.is_contiguous() or residual.dtype != x.dtype:
        raise ValueError("unsummed rows need a contiguous residual of shape [T, D] in the rows' dtype")
    out = torch.empty(t, d, dtype=x.dtype, device=rows.device) if out is None else out
    res_out = torch.empty_like(residual) if residual_out is None else residual_out
    block_d = triton.next_power_of_2(d)
    if t:
        _rms_norm_kernel[(t,)](
            rows,
            residual,
            out,
            res_out,
            weight,
            rows,
            d,
            1,
            0,
            0,
            0,
            0,
            eps,
            HAS_RESIDUAL=True,
            ZERO_CENTERED=zero_centered,
            GATED=False,
            ROWS=True,
            TOP_K=top_k,
            BLOCK_D=block_d,
            num_warps=max(4, block_d // 512),  # the k rows' loads in flight: more threads past 2048
        )
    return out, res_out


def _row_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(inner, stride_outer, stride_inner): row r of x sits at (r // inner) * outer + (r % inner) * inner."""
    if x.dim() == 3:
        return x.shape[1], x.stride(0), x.stride(1)
    return 1, x.stride(0), 0
