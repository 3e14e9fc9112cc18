"""Child side of the unsummed-rows cases (test_kernel_rms_norm.py, test_kernel_moe_combine.py): the norm
or the combine summing a MoE block's rows itself, and the same rows summed first by `sum_rows_triton`,
both under the interpreter."""

from __future__ import annotations

from ferry.kernels.expert_rows_sum import ExpertRows, sum_rows_triton
from ferry.kernels.moe_combine import moe_combine_triton
from ferry.kernels.rms_norm import rms_norm_triton


def folded_and_summed_first(rows, dtype, weight, eps, zero_centered, residual):
    folded = rms_norm_triton(ExpertRows(rows, dtype), weight, eps, zero_centered, residual)
    summed_first = rms_norm_triton(sum_rows_triton(rows, dtype), weight, eps, zero_centered, residual)
    return folded, summed_first


def combine_folded_and_summed_first(rows, dtype, gate, shared):
    folded = moe_combine_triton(ExpertRows(rows, dtype), gate, shared)
    summed_first = moe_combine_triton(sum_rows_triton(rows, dtype), gate, shared)
    return folded, summed_first
