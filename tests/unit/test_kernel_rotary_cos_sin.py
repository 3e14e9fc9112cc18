"""The one-launch rotary tables (kernels/rotary_cos_sin.py) against their torch twin under the
Triton interpreter, in a child process: full and partial rotary, positions up to a 262k context,
float32 and bfloat16."""

import pytest
import torch
from interpreted_triton import run_interpreted

from ferry.kernels.rotary_cos_sin import rotary_cos_sin, rotary_cos_sin_reference
from ferry.services.worker.layers.rotary import RotaryEmbedding

# (head_dim, partial_rotary_factor, theta, tokens, dtype)
CASES = [
    (128, 1.0, 1_000_000.0, 5, torch.float32),  # Qwen3-30B-A3B
    (256, 0.25, 10_000_000.0, 3, torch.bfloat16),  # Qwen3.5/3.6: 64 of 256 channels turn
    (24, 0.5, 10_000.0, 7, torch.float32),  # a rotary width that is not a power of two
]


@pytest.fixture(scope="module")
def runs():
    calls, expected = [], []
    for i, (d, factor, theta, tokens, dtype) in enumerate(CASES):
        g = torch.Generator().manual_seed(300 + i)
        rotary = RotaryEmbedding(d, factor, theta)
        positions = torch.cat([torch.tensor([0, 261_987]), torch.randint(0, 262_144, (tokens - 2,), generator=g)])
        expected.append(rotary_cos_sin_reference(positions, rotary.inv_freq_both, dtype))
        calls.append(((positions, rotary.inv_freq_both, dtype), {}))
    return list(zip(expected, run_interpreted("ferry.kernels.rotary_cos_sin", "rotary_cos_sin_triton", calls)))


@pytest.mark.parametrize("index", range(len(CASES)))
def test_kernel_matches_the_torch_tables(runs, index):
    (want_cos, want_sin), (cos, sin) = runs[index]
    for got, want in ((cos, want_cos), (sin, want_sin)):
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
        # the interpreter's numpy cos/sin and its truncating bf16 cast, against torch's: within an ulp
        tol = dict(rtol=0, atol=2e-6) if got.dtype == torch.float32 else dict(rtol=0, atol=8e-3)
        torch.testing.assert_close(got, want, **tol)


def test_off_the_triton_path_the_module_runs_the_torch_twin():
    rotary = RotaryEmbedding(64, 1.0, 10_000.0)
    positions = torch.arange(9)
    got = rotary.cos_sin(positions, torch.bfloat16)
    want = rotary_cos_sin_reference(positions, rotary.inv_freq_both, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    strided = torch.arange(18)[::2]  # not contiguous: the twin, whatever the device
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            rotary_cos_sin(strided, rotary.inv_freq_both, torch.float32),
            rotary_cos_sin_reference(strided, rotary.inv_freq_both, torch.float32),
        )
    )
