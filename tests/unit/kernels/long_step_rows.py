"""The case both interpreted kernel scripts run (plain and quantized slots): a step past
ROWS_FLOAT32_MAX_TOKENS writes its expert rows in the model's dtype (kernels/expert_rows_sum.py). Imported by
interpreted_grouped_expert_gemm.py and interpreted_quantized_expert_kernels.py, in their TRITON_INTERPRET=1
child process."""

from __future__ import annotations

import torch

from ferry.kernels.align_pairs import align_pairs_by_slot
from ferry.kernels.aligned_blocks import block_m_for
from ferry.kernels.expert_rows_sum import sum_rows_triton
from ferry.kernels.grouped_expert_gemm import grouped_expert_rows_triton
from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_rows_reference


def _nan(x, topk, dtype):
    return torch.full((*topk.shape, x.shape[1]), float("nan"), dtype=dtype)


def bf16_rows_are_the_float32_rows_rounded_once(x, topk, weights, w13, w2, num_slots: int, window: int) -> None:
    """bf16 rows: each routed pair's row is its float32 row rounded once (within one bf16 unit in the last place:
    the interpreter truncates where the GPU rounds to nearest even, which tests/gpu checks bit for bit),
    skipped pairs untouched; the launch in windows of `window` slots gives the bits of one launch; the twin
    rounds its float32 rows to nearest even; and the row sum adds the bf16 rows in k order in float32."""
    skipped = topk < 0
    wide = _nan(x, topk, torch.float32)
    grouped_expert_rows_triton(x, topk, weights, w13, w2, wide)
    at_once = _nan(x, topk, torch.bfloat16)
    grouped_expert_rows_triton(x, topk, weights, w13, w2, at_once)
    aligned = align_pairs_by_slot(topk, num_slots, block_m_for(topk.numel()), num_slots, block_starts=True)
    windowed = _nan(x, topk, torch.bfloat16)
    for lo in range(0, num_slots, window):
        grouped_expert_rows_triton(
            x, None, weights, w13, w2, windowed, aligned=aligned, slot_window=(lo, min(lo + window, num_slots), 0)
        )
    for got in (at_once, windowed):
        assert torch.isnan(got[skipped].float()).all(), "skipped pairs must be left untouched"
        assert not torch.isnan(got[~skipped].float()).any(), "every routed pair must be written"
    assert torch.equal(windowed[~skipped], at_once[~skipped]), "the windows must give the bits of one launch"
    routed, exact = at_once[~skipped].float(), wide[~skipped]
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs()  # 2^-7 |row|: one unit in the last place, at most
    assert ((routed - exact).abs() <= ulp).all(), "a bf16 row must be its float32 row rounded once"
    assert not torch.equal(routed, exact), "the rows must be rounded: float32 rows were written"
    twin, twin32 = _nan(x, topk, torch.bfloat16), _nan(x, topk, torch.float32)
    grouped_expert_rows_reference(x, topk, weights, w13, w2, twin)
    grouped_expert_rows_reference(x, topk, weights, w13, w2, twin32)
    assert torch.equal(twin[~skipped], twin32[~skipped].to(torch.bfloat16)), "the twin rounds to nearest even"
    rows = torch.where(skipped.unsqueeze(-1), 0.0, at_once.float()).to(torch.bfloat16)
    want = rows[:, 0].float()
    for j in range(1, rows.shape[1]):
        want = want + rows[:, j].float()
    got = sum_rows_triton(rows, torch.float32, out=torch.full(want.shape, float("nan")))
    assert torch.equal(got, want), "bf16 rows are added in k order in float32"
