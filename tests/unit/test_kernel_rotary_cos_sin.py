"""The one-launch rotary tables (kernels/rotary_cos_sin.py) against their torch twin under the
Triton interpreter, in a child process: full and partial rotary, positions up to a 262k context,
float32 and bfloat16, and gpt-oss's YaRN tables (their frequencies, cos and sin times its attention factor)."""

import pytest
import torch
from interpreted_triton import run_interpreted

from ferry.kernels.rotary_cos_sin import rotary_cos_sin, rotary_cos_sin_reference
from ferry.plan.model_spec import YarnRope
from ferry.services.worker.layers.rotary import RotaryEmbedding

GPT_OSS_YARN = YarnRope(factor=32.0, original_max_position_embeddings=4096, truncate=False)
# (head_dim, partial_rotary_factor, theta, tokens, dtype, yarn)
CASES = [
    (128, 1.0, 1_000_000.0, 5, torch.float32, None),  # Qwen3-30B-A3B
    (256, 0.25, 10_000_000.0, 3, torch.bfloat16, None),  # Qwen3.5/3.6: 64 of 256 channels turn
    (24, 0.5, 10_000.0, 7, torch.float32, None),  # a rotary width that is not a power of two
    (64, 1.0, 150_000.0, 5, torch.float32, GPT_OSS_YARN),  # gpt-oss
    (64, 1.0, 150_000.0, 4, torch.bfloat16, GPT_OSS_YARN),
]


@pytest.fixture(scope="module")
def runs():
    calls, expected = [], []
    for i, (d, factor, theta, tokens, dtype, yarn) in enumerate(CASES):
        g = torch.Generator().manual_seed(300 + i)
        rotary = RotaryEmbedding(d, factor, theta, yarn=yarn)
        positions = torch.cat([torch.tensor([0, 261_987]), torch.randint(0, 262_144, (tokens - 2,), generator=g)])
        expected.append(rotary_cos_sin_reference(positions, rotary.inv_freq_both, dtype, rotary.scaling))
        calls.append(((positions, rotary.inv_freq_both, dtype, rotary.scaling), {}))
    return list(zip(expected, run_interpreted("ferry.kernels.rotary_cos_sin", "rotary_cos_sin_triton", calls)))


@pytest.mark.parametrize("index", range(len(CASES)))
def test_kernel_matches_the_torch_tables(runs, index):
    (want_cos, want_sin), (cos, sin) = runs[index]
    for got, want in ((cos, want_cos), (sin, want_sin)):
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
        # the interpreter's numpy cos/sin and its truncating bf16 cast, against torch's: within an ulp
        tol = dict(rtol=0, atol=2e-6) if got.dtype == torch.float32 else dict(rtol=0, atol=8e-3)
        torch.testing.assert_close(got, want, **tol)


def test_yarn_tables_are_transformers_cos_and_sin():
    """transformers' GptOssRotaryEmbedding's cos/sin (its halves, which the rotate-half tables repeat)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    theirs = GptOssRotaryEmbedding(GptOssConfig(head_dim=64, max_position_embeddings=131072))
    ours = RotaryEmbedding(64, 1.0, 150_000.0, yarn=GPT_OSS_YARN)
    positions = torch.tensor([0, 1, 127, 4095, 4096, 100_000])
    cos, sin = ours.cos_sin(positions, torch.float32)
    want_cos, want_sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(cos, torch.cat([want_cos[0], want_cos[0]], dim=-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, torch.cat([want_sin[0], want_sin[0]], dim=-1), rtol=0, atol=1e-6)


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
