"""The last step of the routed experts: out[t] = sum over k of rows[t, k], cast to the model dtype.

Both expert stores finish with it, so it is one function: on the Triton path one kernel (instead of
a torch sum and a cast) that adds the k rows in k order in float32, elsewhere the torch twin. The
two stores must finish identically for their results to agree bit for bit, and they do, since
both call this and it depends only on the rows.

A decode step's sum need not be a launch of its own: a store asked for its rows unsummed
(`finish_rows(..., summed=False)`) hands back `ExpertRows`, and the kernel that reads the MoE
output next (the next layer's RMSNorm with its residual add, kernels/rms_norm.py, or the shared
expert's combine, kernels/moe_combine.py) adds the k rows itself, in the same order and in float32,
and rounds the sum to the dtype before using it: the same bits as `sum_rows`, one launch (2.2 µs
and a gap at one token) fewer per MoE layer. Only steps small enough for the pair
kernels do so: their rows are a few hundred KB, and a prefill's rows (up to hundreds of MB) are
freed as soon as they are summed, as the plan's workspace assumes.

The rows are float32 for a step of up to ROWS_FLOAT32_MAX_TOKENS tokens (plan/costs.py) and in the
model's dtype past it (`rows_dtype`, `new_rows`): the kernel that computes a pair's row rounds its float32
value once, to nearest even, and the sum here still adds the k rows in float32, in k order. A long
prefill's float32 rows were the largest part of its workspace (1.07 GB at 16,384 tokens of the 35B)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import use_triton
from ferry.kernels.expert_pair_gemv import use_pair_kernel
from ferry.plan.costs import ROWS_FLOAT32_MAX_TOKENS

BLOCK_H = 1024


def rows_dtype(tokens: int, dtype: torch.dtype) -> torch.dtype:
    """The row buffer's dtype for a step of `tokens` tokens of a model in `dtype`."""
    return torch.float32 if tokens <= ROWS_FLOAT32_MAX_TOKENS else dtype


def new_rows(x: torch.Tensor, top_k: int, zeroed: bool = False) -> torch.Tensor:
    """The row buffer [T, k, H] for the step whose expert input is `x` [T, H], in `rows_dtype`: uninitialised
    where the caller writes every pair, `zeroed` where some pairs are skipped."""
    t, h = x.shape
    make = torch.zeros if zeroed else torch.empty
    return make(t, top_k, h, dtype=rows_dtype(t, x.dtype), device=x.device)


def check_rows(rows: torch.Tensor, x: torch.Tensor, top_k: int) -> None:
    """ValueError unless `rows` is a contiguous [T, k, H] buffer in float32 or in x's dtype."""
    t, h = x.shape
    if rows.dtype not in (torch.float32, x.dtype) or tuple(rows.shape) != (t, top_k, h) or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous [{t}, {top_k}, {h}] tensor in float32 or {x.dtype}")


@dataclass(frozen=True, eq=False)
class ExpertRows:
    """A routed MoE output not yet summed: `rows` float32 [T, k, H] (contiguous), to be summed over k
    in k order and rounded to `dtype` by the kernel that consumes it."""

    rows: torch.Tensor
    dtype: torch.dtype

    def summed(self) -> torch.Tensor:
        return sum_rows(self.rows, self.dtype)


@triton.jit
def _sum_rows_kernel(rows_ptr, out_ptr, top_k, H, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(top_k):
        acc += tl.load(rows_ptr + (t * top_k + j) * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_rows_triton(rows: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows: contiguous [T, k, H], float32 or a 16-bit float -> [T, H] in `dtype`."""
    t, top_k, h = rows.shape
    if rows.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not rows.is_contiguous():
        raise ValueError("rows must be a contiguous [T, k, H] tensor in float32, bfloat16 or float16")
    out = torch.empty(t, h, dtype=dtype, device=rows.device) if out is None else out
    if t:
        _sum_rows_kernel[(t, triton.cdiv(h, BLOCK_H))](rows, out, top_k, h, BLOCK=BLOCK_H)
    return out


def sum_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if use_triton(rows):
        return sum_rows_triton(rows, dtype)
    # the kernel's order (k order, in float32), one [T, H] float32 buffer: no float32 copy of 16-bit rows
    out = rows[:, 0].to(torch.float32, copy=True)
    for j in range(1, rows.shape[1]):
        out += rows[:, j]
    return out.to(dtype)


def finish_rows(rows: torch.Tensor, dtype: torch.dtype, summed: bool = True) -> torch.Tensor | ExpertRows:
    """A store's last step: the summed [T, H], or with `summed=False`, on the Triton path and for a
    step small enough for the pair kernels, the rows themselves for the consumer to sum."""
    t, k, _ = rows.shape
    if not summed and use_triton(rows) and use_pair_kernel(t * k) and rows.is_contiguous():
        return ExpertRows(rows, dtype)
    return sum_rows(rows, dtype)


def summed(x: torch.Tensor | ExpertRows) -> torch.Tensor:
    """x as a [T, H] tensor, whichever a store returned."""
    return x.summed() if isinstance(x, ExpertRows) else x
