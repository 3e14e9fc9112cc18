"""The shared expert's SiLU-and-mul and the MoE block's combine (kernels/moe_combine.py) against
their torch twins under the Triton interpreter, in a child process (interpreted_triton.py).

Rounding is checked op by op: in bf16 each of the twin's ops rounds to the dtype, and so must the
kernel. The interpreter rounds float32 -> bfloat16 toward zero (the GPU to nearest: tests/gpu checks
those bits), so two such roundings may land two ulps from the twin; the real check is that bf16
results equal the twin's op sequence exactly when each rounding is a truncation: a kernel that
rounded once at the end, or skipped a rounding, would not."""

import pytest
import torch
from interpreted_triton import run_interpreted

from ferry.kernels.moe_combine import moe_combine_reference, silu_mul_reference


def _trunc(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 as the interpreter does it (toward zero)."""
    return (x.float().contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


# (T, I or H, dtype): sizes below, at and above one 1024-wide block, not powers of two
SILU_CASES = [(1, 24, torch.float32), (3, 512, torch.bfloat16), (17, 1000, torch.float32), (17, 1536, torch.bfloat16)]
COMBINE_CASES = [
    (1, 32, torch.float32),
    (3, 2048, torch.bfloat16),
    (17, 1000, torch.bfloat16),
    (17, 2500, torch.float32),
]


@pytest.fixture(scope="module")
def silu_runs():
    calls, inputs = [], []
    for i, (t, n, dtype) in enumerate(SILU_CASES):
        gate_up = (torch.randn(t, 2 * n, generator=torch.Generator().manual_seed(i)) * 3).to(dtype)
        inputs.append(gate_up)
        calls.append(((gate_up,), dict(out=torch.full((t, n), float("nan"), dtype=dtype))))
    return list(zip(inputs, run_interpreted("ferry.kernels.moe_combine", "silu_mul_triton", calls)))


@pytest.mark.parametrize("index", range(len(SILU_CASES)))
def test_silu_mul_matches_its_twin(silu_runs, index):
    gate_up, got = silu_runs[index]
    want = silu_mul_reference(gate_up)
    assert got.dtype == want.dtype and got.shape == want.shape and not torch.isnan(got).any()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # exp: ulps
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)  # two truncations
    g, u = gate_up.float().chunk(2, dim=-1)
    assert torch.equal(got, _trunc(_trunc(g / (1 + torch.exp(-g))).float() * u)), "silu rounded, then the product"


@pytest.fixture(scope="module")
def combine_runs():
    calls, inputs = [], []
    for i, (t, h, dtype) in enumerate(COMBINE_CASES):
        g = torch.Generator().manual_seed(10 + i)
        routed, shared = (torch.randn(t, h, generator=g).to(dtype) for _ in range(2))
        gate = torch.rand(t, 1, generator=g).to(dtype)
        inputs.append((routed, gate, shared))
        calls.append(((routed, gate, shared), dict(out=torch.full((t, h), float("nan"), dtype=dtype))))
    return list(zip(inputs, run_interpreted("ferry.kernels.moe_combine", "moe_combine_triton", calls)))


@pytest.mark.parametrize("index", range(len(COMBINE_CASES)))
def test_combine_matches_its_twin(combine_runs, index):
    (routed, gate, shared), got = combine_runs[index]
    want = moe_combine_reference(routed, gate, shared)
    assert got.dtype == want.dtype and not torch.isnan(got).any()
    if got.dtype == torch.float32:
        assert torch.equal(got, want)
        return
    # two truncations, the second of a sum that may cancel: two ulps of the O(1) operands
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-5)
    product = _trunc(gate.float() * shared.float())
    assert torch.equal(got, _trunc(routed.float() + product.float())), "the product rounded, then the sum"


def test_the_combine_summing_unsummed_rows_gives_the_bits_of_summing_them_first():
    """A shared-expert block hands its routed rows to the combine unsummed (kernels/expert_rows_sum.py):
    the combine's own k-order sum must give what summing first and combining gave, with the shared
    expert's output in the dtype and as float32 rows."""
    calls = []
    for i, (t, k, h, dtype, shared_fp32) in enumerate(
        [(1, 8, 48, torch.bfloat16, True), (3, 4, 100, torch.float32, False), (2, 3, 64, torch.bfloat16, False)]
    ):
        g = torch.Generator().manual_seed(400 + i)
        rows = torch.randn(t, k, h, generator=g) * 2
        gate = torch.rand(t, 1, generator=g).to(dtype)
        shared = torch.randn(t, h, generator=g).to(dtype)
        calls.append(((rows, dtype, gate, shared.float() if shared_fp32 else shared), {}))
    outs = run_interpreted("tests.unit.interpreted_rows_norm", "combine_folded_and_summed_first", calls)
    for (args, _), (folded, summed_first) in zip(calls, outs):
        assert folded.dtype == args[1] and folded.shape == (args[0].shape[0], args[0].shape[2])
        assert not torch.isnan(folded).any() and torch.equal(folded, summed_first)
