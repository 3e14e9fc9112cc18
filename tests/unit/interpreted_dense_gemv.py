"""Child-side helper of test_kernel_dense_gemv.py: tiles cross the process boundary as a tuple
(torch.load in the child takes tensors and plain values only)."""

from __future__ import annotations

from ferry.kernels.dense_gemv import GemvTiles, dense_gemv_triton


def gemv(x, weight, bias, tiles):
    return dense_gemv_triton(x, weight, bias, GemvTiles(*tiles) if tiles else None)
