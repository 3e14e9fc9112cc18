"""The fused q/k norm + rotary + K/V write kernel against its torch twin (norms.py, rotary.py,
write_kv) under the Triton interpreter in a child process. Fresh inputs; q output and the whole
KV pool poisoned with NaN, so unwritten elements and writes to the wrong rows both show."""

import pytest
import torch

from interpreted_triton import run_interpreted
from ferry.kernels.paged_attention_reference import write_kv
from ferry.services.worker.models.norms import make_norm
from ferry.services.worker.models.rotary import RotaryEmbedding

# (tokens, heads, kv_heads, head_dim, partial_rotary_factor, zero_centred, gated q, dtype)
CASES = [
    (3, 4, 2, 16, 1.0, False, False, torch.float32),
    (5, 6, 2, 24, 0.25, True, True, torch.float32),  # qwen3_next-like: partial rotary, gated q, (1+w)
    (2, 4, 1, 32, 1.0, False, False, torch.bfloat16),
    (4, 2, 2, 20, 0.5, True, True, torch.bfloat16),  # head_dim not a power of two
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
        calls.append(((q, k, v, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6, case[5], cos, sin,
                       rotary.rotary_dim, slots, cache.clone(), cache.clone()), dict(q_out=q_out)))  # fmt: skip
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
