"""The fused RMSNorm kernel against its twins (the torch modules in norms.py) under the Triton
interpreter, in a child process (interpreted_triton.py). Fresh random inputs, outputs poisoned."""

import pytest
import torch
from interpreted_triton import run_interpreted

from ferry.services.worker.layers.norms import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm

# (shape, strided per-head view?, zero-centred?, with residual?, dtype)
CASES = [
    ((3, 48), False, False, False, torch.float32),
    ((5, 100), False, True, True, torch.float32),  # D not a power of two: masked tail
    ((2, 64), False, False, True, torch.bfloat16),
    ((4, 3, 16), True, False, False, torch.bfloat16),  # q heads split out of a gated projection
    ((4, 3, 16), True, True, False, torch.float32),
]


def _case(seed, shape, strided, zero_centered, with_residual, dtype):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    norm = (ZeroCenteredRMSNorm if zero_centered else RMSNorm)(d, 1e-6, dtype)
    norm.weight.copy_(torch.randn(d, generator=g) * 0.3 + (0.0 if zero_centered else 1.0))
    if strided:  # every head's query followed by its gate, as q_proj yields them when gated
        x = (torch.randn(shape[0], shape[1], 2 * d, generator=g) * 3).to(dtype).split(d, dim=-1)[0]
    else:
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    residual = torch.randn(*shape, generator=g).to(dtype) if with_residual else None
    return norm, x, residual


@pytest.fixture(scope="module")
def runs():
    calls, expected = [], []
    for i, (shape, strided, zc, with_res, dtype) in enumerate(CASES):
        norm, x, residual = _case(i, shape, strided, zc, with_res, dtype)
        if residual is None:
            expected.append((norm.reference(x), None))
        else:
            summed = residual + x
            expected.append((norm.reference(summed), summed))
        poison = dict(out=torch.full(shape, float("nan"), dtype=dtype))
        if residual is not None:
            poison["residual_out"] = torch.full(shape, float("nan"), dtype=dtype)
        calls.append(((x, norm.weight.detach(), 1e-6, zc, residual), poison))
    outs = run_interpreted("ferry.kernels.rms_norm", "rms_norm_triton", calls)
    return list(zip(expected, outs))


@pytest.mark.parametrize("index", range(len(CASES)))
def test_kernel_matches_the_torch_norm(runs, index):
    (want, want_residual), got = runs[index]
    if want_residual is not None:
        got, got_residual = got
        if got.dtype == torch.float32:
            assert torch.equal(got_residual, want_residual), "the residual sum must be exactly residual + x"
        else:  # the interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest): one ulp
            torch.testing.assert_close(got_residual, want_residual, rtol=1e-2, atol=0)
    assert got.is_contiguous() and not torch.isnan(got).any()
    tol = 1e-5 if got.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# (shape, dtype): Gated DeltaNet's output norm, the gate a strided view as split from in_proj
GATED_CASES = [((3, 2, 24), torch.float32), ((4, 3, 16), torch.bfloat16)]


@pytest.fixture(scope="module")
def gated_runs():
    calls, expected = [], []
    for i, (shape, dtype) in enumerate(GATED_CASES):
        g = torch.Generator().manual_seed(100 + i)
        d = shape[-1]
        norm = GatedRMSNorm(d, 1e-6, dtype)
        norm.weight.copy_(torch.randn(d, generator=g) * 0.3 + 1.0)
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
        gate = (torch.randn(shape[0], shape[1], 3 * d, generator=g) * 2).to(dtype)[..., d : 2 * d]
        expected.append(norm.reference(x, gate))
        calls.append(
            ((x, norm.weight.detach(), 1e-6, False), dict(gate=gate, out=torch.full(shape, float("nan"), dtype=dtype)))
        )
    outs = run_interpreted("ferry.kernels.rms_norm", "rms_norm_triton", calls)
    return list(zip(expected, outs))


@pytest.mark.parametrize("index", range(len(GATED_CASES)))
def test_gated_kernel_matches_the_torch_norm(gated_runs, index):
    want, got = gated_runs[index]
    assert not torch.isnan(got).any()
    tol = 1e-5 if got.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_forward_add_on_cpu_is_add_then_norm():
    norm, x, residual = _case(9, (3, 32), False, False, True, torch.bfloat16)
    out, summed = norm.forward_add(x, residual)
    assert torch.equal(summed, residual + x) and torch.equal(out, norm(residual + x))


# (tokens, k, D, zero-centred?, dtype): a MoE block's unsummed rows (kernels/expert_rows_sum.py)
ROWS_CASES = [(1, 8, 48, False, torch.bfloat16), (3, 3, 100, True, torch.float32), (2, 4, 64, True, torch.bfloat16)]


def test_the_norm_summing_unsummed_rows_gives_the_bits_of_summing_them_first():
    calls = []
    for i, (t, k, d, zc, dtype) in enumerate(ROWS_CASES):
        g = torch.Generator().manual_seed(200 + i)
        norm = (ZeroCenteredRMSNorm if zc else RMSNorm)(d, 1e-6, dtype)
        norm.weight.copy_(torch.randn(d, generator=g) * 0.3 + (0.0 if zc else 1.0))
        rows = torch.randn(t, k, d, generator=g) * 2
        residual = torch.randn(t, d, generator=g).to(dtype)
        calls.append(((rows, dtype, norm.weight.detach(), 1e-6, zc, residual), {}))
    outs = run_interpreted("tests.unit.interpreted_rows_norm", "folded_and_summed_first", calls)
    for (t, k, d, _, dtype), ((out, res), (want_out, want_res)) in zip(ROWS_CASES, outs):
        assert out.shape == (t, d) and out.dtype == dtype and not torch.isnan(out).any()
        assert torch.equal(res, want_res) and torch.equal(out, want_out)
