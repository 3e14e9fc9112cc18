"""The shared expert's elementwise steps, one Triton launch each: SiLU-and-mul after its fused
gate/up GEMV, and the combine of the MoE block's two halves.

Twins: `silu_mul_reference` and `moe_combine_reference` below, the torch sequences the CPU path
runs (services/worker/layers/mlp.py); plain torch launches two kernels for the first (silu, mul)
and three for the second (sigmoid is the router kernel's now; mul, add).

* `silu_mul(gate_up)`: gate_up [T, 2I] is the output of one GEMV over the stacked [gate; up]
  weight; returns silu(gate) * up [T, I]. Rounded as torch rounds `F.silu(gate) * up` on
  model-dtype tensors: silu computed in float32 and rounded to the dtype, then the product of the
  two dtype values computed in float32 and rounded.
* `moe_combine(routed, gate, shared)`: routed + gate * shared, where gate [T, 1] is the shared
  expert's sigmoid(gate logit) (already in the dtype) and shared [T, H] the shared expert's
  output (or float32 rows holding such values); `routed` may also be a store's unsummed rows
  (kernels/expert_rows_sum.py), which the kernel sums first as `sum_rows` would. The kernel is written as torch's
  `out + g * s` rounds (the product to the dtype, then the sum), but the compiled kernel does not keep the
  product's rounding: on a Hopper card 13.5% of a row's elements came out an ulp (of the operands)
  apart from torch's, every one within it (tests/gpu/test_moe_block_cuda.py). That is the
  sum rounded once, closer to the exact value; the CPU twin keeps torch's two roundings.

The token count only sets the grid (no compile while serving).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ferry.kernels.dispatch import use_triton
from ferry.kernels.expert_rows_sum import ExpertRows, summed

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, I, BLOCK_I: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = offs < I
    src = gate_up_ptr + t * 2 * I
    g = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(src + I + offs, mask=ok, other=0.0)
    ty = out_ptr.dtype.element_ty
    silu = (g / (1.0 + tl.exp(-g))).to(ty)
    tl.store(out_ptr + t * I + offs, (silu.to(tl.float32) * u.to(tl.float32)).to(ty), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up: contiguous [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], contiguous [T, I]."""
    t, two_i = gate_up.shape
    if gate_up.dim() != 2 or two_i % 2 or not gate_up.is_contiguous():
        raise ValueError(f"gate_up must be a contiguous [T, 2I] tensor, got {tuple(gate_up.shape)}")
    i = two_i // 2
    out = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    if t:
        block = min(BLOCK, triton.next_power_of_2(i))
        _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, BLOCK_I=block)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate_up):
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


@triton.jit
def _moe_combine_kernel(
    routed_ptr, gate_ptr, shared_ptr, out_ptr, H, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, TOP_K: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    ty = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + t).to(tl.float32)
    s = tl.load(shared_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)
    if ROWS:  # routed_ptr: float32 [T, TOP_K, H], summed in k order and rounded as sum_rows does
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):  # unrolled: the k loads go out together (kernels/rms_norm.py)
            acc += tl.load(routed_ptr + (t * TOP_K + j) * H + offs, mask=ok, other=0.0)
        r = acc.to(ty).to(tl.float32)
    else:
        r = tl.load(routed_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)
    scaled = (g * s).to(ty)
    tl.store(out_ptr + t * H + offs, (r + scaled.to(tl.float32)).to(ty), mask=ok)


def moe_combine_triton(
    routed: torch.Tensor | ExpertRows, gate: torch.Tensor, shared: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """routed, shared: [T, H]; gate: [T, 1]; one dtype, except that `shared` may be float32 holding values
    of that dtype (the pair kernels' rows, DenseMLP.forward_rows) -> contiguous [T, H] in routed's dtype.
    `routed` may be a store's unsummed rows (`ExpertRows`): the kernel sums them as `sum_rows` does."""
    unsummed, dtype, top_k = isinstance(routed, ExpertRows), routed.dtype, 1
    if unsummed:
        top_k, routed = routed.rows.shape[1], routed.rows  # contiguous float32 [T, k, H] (finish_rows)
    t, h = routed.shape[0], routed.shape[-1]
    shared_ok = shared.dtype in (dtype, torch.float32)
    if tuple(shared.shape) != (t, h) or gate.shape != (t, 1) or dtype != gate.dtype or not shared_ok:
        raise ValueError(
            f"moe_combine: routed {tuple(routed.shape)} {dtype}, gate {tuple(gate.shape)} "
            f"{gate.dtype}, shared {tuple(shared.shape)} {shared.dtype}"
        )
    # a store returns its own [T, H] (contiguous from both of today's); anything else is made so
    routed, gate, shared = (x if x.is_contiguous() else x.contiguous() for x in (routed, gate, shared))
    out = torch.empty(t, h, dtype=dtype, device=routed.device) if out is None else out
    if t:
        block = min(BLOCK, triton.next_power_of_2(h))
        _moe_combine_kernel[(t, triton.cdiv(h, block))](
            routed, gate, shared, out, h, BLOCK_H=block, ROWS=unsummed, TOP_K=top_k
        )
    return out


def moe_combine_reference(routed: torch.Tensor | ExpertRows, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    return summed(routed) + gate * shared


def moe_combine(routed: torch.Tensor | ExpertRows, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    if use_triton(routed.rows if isinstance(routed, ExpertRows) else routed):
        return moe_combine_triton(routed, gate, shared)
    return moe_combine_reference(routed, gate, shared)
