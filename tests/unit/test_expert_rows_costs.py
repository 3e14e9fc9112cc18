"""The expert stores' row buffer in the plan's prices (plan/costs.py): float32 rows up to
ROWS_FLOAT32_MAX_TOKENS tokens, rows in the model's dtype past it, and the widest of any step up to the
longest priced, in the estimate and beside the boot profile."""

from __future__ import annotations

import ferry.plan.costs as costs
from ferry.plan.costs import (
    ROWS_FLOAT32_MAX_TOKENS,
    rows_beyond_longest_step,
    widest_rows_bytes,
    workspace_bytes_estimate,
)
from ferry.plan.model_config import load_model_config
from tests.helpers import QWEN3_6_35B

MIB = 2**20


def _estimate(spec, tokens: int) -> int:
    return workspace_bytes_estimate(spec, "bfloat16", tokens, 8, 262144)


def test_a_long_steps_rows_are_priced_in_the_dtype_and_a_short_steps_unchanged(monkeypatch):
    spec = load_model_config(QWEN3_6_35B)
    row = spec.num_experts_per_tok * spec.hidden_size
    narrow = {t: _estimate(spec, t) for t in (8192, 16384)}
    monkeypatch.setattr(costs, "ROWS_FLOAT32_MAX_TOKENS", 10**6)  # float32 rows at every length: the old price
    wide = {t: _estimate(spec, t) for t in (8192, 16384)}
    assert narrow[8192] == wide[8192]
    saved = wide[16384] - narrow[16384]  # the estimate's 25 % margin over 16,384 rows of 2 bytes less a value
    assert abs(saved - 1.25 * 16384 * row * 2) <= MIB, saved
    assert saved > 600 * MIB  # the 35B's 16k step: ~0.54 GB of rows (x 1.25)


def test_the_estimate_never_falls_as_the_step_grows():
    """Past the threshold the longest step's bf16 rows (9,000 x 2 bytes a value) hold less than an 8,192-token
    step's float32 ones, which may run too: the widest of them is priced, so a longer step never costs less."""
    spec = load_model_config(QWEN3_6_35B)
    lengths = sorted({*range(512, 20000, 512), *range(8180, 8210), 9000, 12000, 16383, 16384, 16385})
    estimates = [_estimate(spec, t) for t in lengths]
    assert all(b >= a for a, b in zip(estimates, estimates[1:])), [(t, e // MIB) for t, e in zip(lengths, estimates)]


def test_the_profile_adds_the_rows_a_shorter_step_holds_beyond_the_longest():
    spec = load_model_config(QWEN3_6_35B)
    row = spec.num_experts_per_tok * spec.hidden_size
    float32_8k = ROWS_FLOAT32_MAX_TOKENS * row * 4
    assert rows_beyond_longest_step(spec, "bfloat16", 4096) == 0
    assert rows_beyond_longest_step(spec, "bfloat16", ROWS_FLOAT32_MAX_TOKENS) == 0
    assert rows_beyond_longest_step(spec, "bfloat16", 9000) == float32_8k - 9000 * row * 2
    assert rows_beyond_longest_step(spec, "bfloat16", 16384) == 0  # 16,384 bf16 rows hold what 8,192 float32 do
    assert rows_beyond_longest_step(spec, "bfloat16", 20000) == 0
    assert widest_rows_bytes(spec, "bfloat16", 9000) == float32_8k
    assert widest_rows_bytes(spec, "float32", 16384) == 16384 * row * 4  # a float32 model's rows stay float32
