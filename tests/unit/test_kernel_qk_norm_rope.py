"""The fused q/k norm + rotary + K/V write kernel against its torch twin (norms.py, rotary.py,
write_kv) under the Triton interpreter in a child process. Fresh inputs; q output and the whole
KV pool poisoned with NaN, so unwritten elements and writes to the wrong rows both show."""

import pytest
import torch
from interpreted_triton import run_interpreted

from ferry.kernels.paged_attention_reference import write_kv
from ferry.services.worker.layers.norms import make_norm
from ferry.services.worker.layers.rotary import RotaryEmbedding

# (tokens, heads, kv_heads, head_dim, partial_rotary_factor, zero_centred, gated q, dtype)
CASES = [
    (3, 4, 2, 16, 1.0, False, False, torch.float32),
    (5, 6, 2, 24, 0.25, True, True, torch.float32),  # qwen3_next-like: partial rotary, gated q, (1+w)
    (2, 4, 1, 32, 1.0, False, False, torch.bfloat16),
    (4, 2, 2, 20, 0.5, True, True, torch.bfloat16),  # head_dim not a power of two
    (3, 0, 2, 24, 0.25, True, False, torch.bfloat16),  # no query heads: the MTP head's K/V write (mtp_head.py)
]


def _case(seed, tokens, heads, kv_heads, d, factor, zero_centered, gated, dtype):
    g = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding(d, factor, 10000.0)
    q_norm, k_norm = make_norm(zero_centered, d, 1e-6, dtype), make_norm(zero_centered, d, 1e-6, dtype)
    for n in (q_norm, k_norm):
        n.weight.copy_(torch.randn(d, generator=g) * 0.3 + (0.0 if zero_centered else 1.0))
    width = 2 * d if gated else d  # a gated projection interleaves each head's query and gate
    q = (torch.randn(tokens, heads, width, generator=g) * 2).to(dtype)[..., :d]
    k = (torch.randn(tokens, kv_heads, d, generator=g) * 2).to(dtype)
    v = torch.randn(tokens, kv_heads, d, generator=g).to(dtype)
    positions = torch.randint(0, 5000, (tokens,), generator=g)
    cos, sin = rotary.cos_sin(positions, dtype)
    pages, page_size = 4, 4
    slot_mapping = torch.randperm(pages * page_size, generator=g)[:tokens]
    cache = torch.full((pages, page_size, kv_heads, d), float("nan"), dtype=dtype)
    return rotary, q_norm, k_norm, q, k, v, cos, sin, slot_mapping, cache


@pytest.fixture(scope="module")
def runs():
    calls, expected = [], []
    for i, case in enumerate(CASES):
        rotary, q_norm, k_norm, q, k, v, cos, sin, slots, cache = _case(i, *case)
        want_k, want_v = cache.clone(), cache.clone()
        write_kv(want_k, want_v, slots, rotary.apply(k_norm(k), cos, sin), v)
        expected.append((rotary.apply(q_norm(q), cos, sin), want_k, want_v))
        q_out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        calls.append(
            (
                (
                    q,
                    k,
                    v,
                    q_norm.weight.detach(),
                    k_norm.weight.detach(),
                    1e-6,
                    case[5],
                    cos,
                    sin,
                    rotary.rotary_dim,
                    slots,
                    cache.clone(),
                    cache.clone(),
                ),
                dict(q_out=q_out),
            )
        )
    outs = run_interpreted("tests.unit.kernels.qk_norm_rope_entry", "run_and_return_caches", calls)
    return list(zip(expected, outs))


@pytest.mark.parametrize("index", range(len(CASES)))
def test_kernel_matches_the_torch_path(runs, index):
    (want_q, want_k, want_v), (q, k_cache, v_cache) = runs[index]
    tol = 1e-5 if q.dtype == torch.float32 else 2e-2
    assert q.is_contiguous()
    torch.testing.assert_close(q.float(), want_q.float(), rtol=tol, atol=tol)
    written = ~torch.isnan(want_k)
    assert torch.equal(~torch.isnan(k_cache), written) and torch.equal(~torch.isnan(v_cache), written)
    torch.testing.assert_close(k_cache[written].float(), want_k[written].float(), rtol=tol, atol=tol)
    assert torch.equal(v_cache[written], want_v[written])


@pytest.fixture(scope="module")
def fp8_runs():
    """The same cases into an fp8 pool (--kv-cache-dtype fp8): e4m3 caches and float32 scales, all poisoned."""
    calls, expected = [], []
    for i, case in enumerate(CASES):
        rotary, q_norm, k_norm, q, k, v, cos, sin, slots, cache = _case(i, *case)
        fp8 = torch.full(cache.shape, float("nan"), dtype=torch.float8_e4m3fn)
        scale = torch.full(cache.shape[:-1], float("nan"))
        want = (fp8.clone(), fp8.clone(), scale.clone(), scale.clone())
        k_rows = rotary.apply(k_norm(k), cos, sin)
        write_kv(want[0], want[1], slots, k_rows, v, want[2], want[3])
        expected.append(want)
        calls.append(
            (
                (
                    q,
                    k,
                    v,
                    q_norm.weight.detach(),
                    k_norm.weight.detach(),
                    1e-6,
                    case[5],
                    cos,
                    sin,
                    rotary.rotary_dim,
                    slots,
                    fp8.clone(),
                    fp8.clone(),
                ),
                dict(k_scale=scale.clone(), v_scale=scale.clone()),
            )
        )
    outs = run_interpreted("tests.unit.kernels.qk_norm_rope_entry", "run_and_return_caches_and_scales", calls)
    return list(zip(expected, outs))


@pytest.mark.parametrize("index", range(len(CASES)))
def test_kernel_quantizes_kv_rows_as_the_torch_path(fp8_runs, index):
    """V rows (copied, not computed) take the twin's exact bytes and scales: the same quantization rule. K rows
    are the kernel's own normed and rotated values, which differ from the twin's within the rounding of the
    model dtype (test above), so their dequantized values agree within that and one e4m3 step."""
    (want_k, want_v, want_ks, want_vs), (_, k_cache, v_cache, k_scale, v_scale) = fp8_runs[index]
    written = ~torch.isnan(want_ks)
    assert torch.equal(~torch.isnan(k_scale), written) and torch.equal(~torch.isnan(v_scale), written)
    assert torch.equal(~torch.isnan(k_cache.float()), ~torch.isnan(want_k.float())), "a row written elsewhere"
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert torch.equal(v_scale[written], want_vs[written])
    k = k_cache.float()[written] * k_scale[written][:, None]
    want = want_k.float()[written] * want_ks[written][:, None]
    amax = want.abs().amax(-1, keepdim=True)
    assert ((k - want).abs() <= want.abs() * 2**-3 + amax * 3e-2).all()
    torch.testing.assert_close(k_scale[written], want_ks[written], rtol=3e-2, atol=0)
