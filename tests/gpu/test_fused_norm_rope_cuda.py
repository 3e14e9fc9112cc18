"""The fused RMSNorm and q/k norm + rotary + KV-write kernels compiled on a real GPU against their
torch twins (skipped without CUDA). Under the interpreter (tests/unit) bf16 conversion truncates;
here it rounds to nearest, so the residual sum must match exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_kernel_qk_norm_rope import CASES as ROPE_CASES  # noqa: E402
from test_kernel_qk_norm_rope import _case as rope_case
from test_kernel_rms_norm import CASES as NORM_CASES  # noqa: E402
from test_kernel_rms_norm import GATED_CASES
from test_kernel_rms_norm import _case as norm_case

from ferry.kernels.paged_attention_reference import write_kv  # noqa: E402
from ferry.kernels.qk_norm_rope import qk_norm_rope_kv_triton  # noqa: E402
from ferry.kernels.rms_norm import rms_norm_triton  # noqa: E402
from ferry.services.worker.layers.norms import GatedRMSNorm  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("index", range(len(NORM_CASES)))
def test_rms_norm_on_cuda(index):
    shape, strided, zc, with_res, dtype = NORM_CASES[index]
    norm, x, residual = norm_case(index, shape, strided, zc, with_res, dtype)
    norm = norm.cuda()
    x = x.cuda()
    if residual is None:
        got, want = rms_norm_triton(x, norm.weight, 1e-6, zc), norm.reference(x)
    else:
        residual = residual.cuda()
        (got, got_res), want = rms_norm_triton(x, norm.weight, 1e-6, zc, residual), norm.reference(residual + x)
        assert torch.equal(got_res, residual + x)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("index", range(len(ROPE_CASES)))
def test_qk_norm_rope_kv_on_cuda(index):
    case = ROPE_CASES[index]
    rotary, q_norm, k_norm, q, k, v, cos, sin, slots, cache = rope_case(index, *case)
    rotary, q_norm, k_norm = rotary.cuda(), q_norm.cuda(), k_norm.cuda()
    q, k, v, cos, sin, slots, cache = (t.cuda() for t in (q, k, v, cos, sin, slots, cache))
    want_k, want_v = cache.clone(), cache.clone()
    write_kv(want_k, want_v, slots, rotary.apply(k_norm.reference(k), cos, sin), v)
    want_q = rotary.apply(q_norm.reference(q), cos, sin)
    got_k, got_v = cache.clone(), cache.clone()
    got_q = qk_norm_rope_kv_triton(
        q, k, v, q_norm.weight, k_norm.weight, 1e-6, case[5], cos, sin, rotary.rotary_dim, slots, got_k, got_v
    )
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=tol, atol=tol)
    written = ~torch.isnan(want_k)
    assert torch.equal(~torch.isnan(got_k), written)
    torch.testing.assert_close(got_k[written].float(), want_k[written].float(), rtol=tol, atol=tol)
    assert torch.equal(got_v[written], want_v[written])


@pytest.mark.parametrize("shape,dtype", GATED_CASES)
def test_gated_rms_norm_on_cuda(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(5)
    d = shape[-1]
    norm = GatedRMSNorm(d, 1e-6, dtype, device="cuda")
    norm.weight.copy_(torch.randn(d, device="cuda", generator=g) * 0.3 + 1.0)
    x = (torch.randn(*shape, device="cuda", generator=g) * 3).to(dtype)
    gate = (torch.randn(shape[0], shape[1], 3 * d, device="cuda", generator=g) * 2).to(dtype)[..., d : 2 * d]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(norm(x, gate).float(), norm.reference(x, gate).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_in_one_launch_match_torch_on_cuda(dtype):
    """kernels/rotary_cos_sin.py against the torch sequence it replaces, at both served rotary shapes
    and positions across a 262k context: libdevice's cosf/sinf on both sides, within an ulp."""
    from ferry.kernels.rotary_cos_sin import rotary_cos_sin_reference, rotary_cos_sin_triton
    from ferry.services.worker.layers.rotary import RotaryEmbedding

    g = torch.Generator(device="cuda").manual_seed(5)
    for head_dim, factor, theta in ((128, 1.0, 1_000_000.0), (256, 0.25, 10_000_000.0)):
        rotary = RotaryEmbedding(head_dim, factor, theta, "cuda")
        positions = torch.randint(0, 262_144, (4096,), device="cuda", generator=g)
        for got, want in zip(
            rotary_cos_sin_triton(positions, rotary.inv_freq_both, dtype),
            rotary_cos_sin_reference(positions, rotary.inv_freq_both, dtype),
        ):
            tol = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=2**-7)
            torch.testing.assert_close(got, want, **tol)
            assert (got != want).float().mean() < 0.01, f"{float((got != want).float().mean()):.2%} differ"
