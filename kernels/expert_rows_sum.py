"""The last step of the routed experts: out[t] = sum over k of rows[t, k], cast to the model dtype.

Both expert stores finish with it, so it is one function: on the Triton path one kernel (instead of
a torch sum and a cast) that adds the k rows in k order in float32, elsewhere the torch twin. The
two stores must finish identically for their results to agree bit for bit, and they do, since
both call this and it depends only on the rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import use_triton

BLOCK_H = 1024


@triton.jit
def _sum_rows_kernel(rows_ptr, out_ptr, top_k, H, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(top_k):
        acc += tl.load(rows_ptr + (t * top_k + j) * H + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_rows_triton(rows: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows: contiguous float32 [T, k, H] -> [T, H] in `dtype`."""
    t, top_k, h = rows.shape
    if rows.dtype != torch.float32 or not rows.is_contiguous():
        raise ValueError("rows must be a contiguous float32 [T, k, H] tensor")
    out = torch.empty(t, h, dtype=dtype, device=rows.device) if out is None else out
    if t:
        _sum_rows_kernel[(t, triton.cdiv(h, BLOCK_H))](rows, out, top_k, h, BLOCK=BLOCK_H)
    return out


def sum_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if use_triton(rows):
        return sum_rows_triton(rows, dtype)
    return rows.sum(dim=1).to(dtype)
