"""The decode projections' GEMV (kernels/dense_gemv.py) against F.linear in float32, under the Triton
interpreter in a child process (interpreted_triton.py): one token and the dot path, bias or none,
N and K that no tile divides, a row view of a fused weight, several loop steps. And the dispatch:
F.linear itself off the Triton path, past the kernel's token count and where the measured table
leaves a shape to cuBLAS."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from interpreted_triton import run_interpreted

from ferry.kernels.dense_gemv import DENSE_GEMV_MAX_TOKENS, GemvTiles, dense_linear, tiles_for, use_dense_gemv

# (M, N, K, dtype, bias, tiles or None): None takes the table's
CASES = [
    (1, 40, 96, torch.float32, False, None),
    (1, 129, 200, torch.bfloat16, True, None),  # N and K no tile divides
    (1, 64, 160, torch.float32, True, GemvTiles(rows=8, k=32, stages=1)),  # five loop steps
    (1, 1, 64, torch.bfloat16, False, None),  # a shared expert's gate: one output
    (3, 33, 80, torch.float32, True, None),
    (8, 48, 128, torch.bfloat16, False, GemvTiles(rows=16, k=32, stages=2)),
    (16, 130, 72, torch.bfloat16, True, None),  # the dot path's whole token block
    (5, 1, 64, torch.float32, False, None),
]


def _inputs(i, m, n, k, dtype, bias):
    g = torch.Generator().manual_seed(i)
    fused = torch.randn(n + 7, k, generator=g).to(dtype)  # the weight: rows 3.. of a fused one
    weight = fused[3 : 3 + n]
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, weight, b


@pytest.fixture(scope="module")
def runs():
    calls = [((*_inputs(i, *c[:5]), c[5] and dataclasses.astuple(c[5])), {}) for i, c in enumerate(CASES)]
    return run_interpreted("tests.unit.interpreted_dense_gemv", "gemv", calls)


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-{str(c[3])[6:]}-bias{c[4]}" for c in CASES]
)
def test_gemv_matches_linear_in_float32(runs, index):
    m, n, k, dtype, bias, _ = CASES[index]
    x, weight, b = _inputs(index, m, n, k, dtype, bias)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = runs[index]
    assert got.shape == (m, n) and got.dtype == dtype
    # float32: the sum's order; bf16: one rounding of the output (the interpreter truncates where the GPU rounds)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


def test_off_the_triton_path_it_is_linear_itself():
    x, w = torch.randn(2, 3, 16), torch.randn(8, 16)
    assert torch.equal(dense_linear(x, w), F.linear(x, w))  # any rank on CPU
    assert not use_dense_gemv(x[0], w)  # a CPU tensor, FERRY_TRITON_ON_CPU unset


def test_the_kernel_takes_only_a_decode_steps_rows(monkeypatch):
    import ferry.kernels.dense_gemv as dense_gemv

    monkeypatch.setattr(dense_gemv, "use_triton", lambda t: True)
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    assert use_dense_gemv(torch.randn(DENSE_GEMV_MAX_TOKENS, 16, dtype=torch.bfloat16), w)
    assert not use_dense_gemv(torch.randn(DENSE_GEMV_MAX_TOKENS + 1, 16, dtype=torch.bfloat16), w)  # prefill
    assert not use_dense_gemv(torch.randn(1, 16), w)  # dtypes differ
    assert not use_dense_gemv(torch.randn(1, 32, dtype=torch.bfloat16)[:, ::2], w)  # strided inputs
    assert not use_dense_gemv(torch.randn(1, 16, dtype=torch.bfloat16), w, torch.randn(16, dtype=torch.bfloat16)[::2])
    with pytest.raises(ValueError, match="1-16 rows"):
        dense_gemv.dense_gemv_triton(torch.randn(17, 16, dtype=torch.bfloat16), w)


def test_a_sweeps_choices_replace_the_table(tmp_path, monkeypatch):
    import json

    import ferry.kernels.dense_gemv as dense_gemv

    monkeypatch.setattr(dense_gemv, "TILES", {(1, 1): (None, None)})
    one = {"rows": 8, "k": 256, "warps": 4, "stages": 1}
    sweep = tmp_path / "dense_gemv_sweep.json"
    sweep.write_text(json.dumps({"chosen": {"5120x2048": [one, None], "128x2048": [None, None]}}))
    dense_gemv._load_override(str(sweep))
    assert dense_gemv.TILES == {(5120, 2048): (GemvTiles(**one), None), (128, 2048): (None, None)}
    assert tiles_for(1, 5120, 2048) == GemvTiles(**one)
    assert tiles_for(8, 5120, 2048) is None  # cuBLAS for the dot path of that shape
    assert tiles_for(1, 128, 2048) is None  # and for the whole of that one
