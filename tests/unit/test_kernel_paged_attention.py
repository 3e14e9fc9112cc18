"""Paged attention: the reference twin against plain causal attention on contiguous K/V, and the
Triton kernel (interpreted on CPU) against the twin, on shapes that stress the page table."""

from __future__ import annotations

import random

import pytest
import torch
from interpreted_triton import run_interpreted

from ferry.kernels.kv_ring import ring_rows
from ferry.kernels.paged_attention_reference import (
    KV_FP8_MAX,
    gather_request_kv,
    paged_attention_reference,
    quantize_kv_rows,
    write_kv,
)
from ferry.plan.kv_groups import ring_pages
from ferry.shared.units import ceil_div


def _scenario(
    seed, page_size, heads, kv_heads, head_dim, query_lens, context_lens, dtype=torch.float32, kv_cache_dtype="auto"
):
    """A poisoned pool, each request's K/V written into shuffled pages; returns everything the kernels need.
    With kv_cache_dtype fp8 the caches are e4m3 and `scales` (k_scale, v_scale), poisoned too, else
    (None, None); dense_k / dense_v are what was written, before quantization."""
    g = torch.Generator().manual_seed(seed)
    totals = [q + c for q, c in zip(query_lens, context_lens)]
    pages_needed = [ceil_div(t, page_size) for t in totals]
    num_pages = sum(pages_needed) + 3
    cache_dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else dtype
    k_cache = torch.full((num_pages + 1, page_size, kv_heads, head_dim), float("nan"), dtype=cache_dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    scales = (None, None)
    if kv_cache_dtype == "fp8":
        scales = (torch.full(k_cache.shape[:-1], float("nan")), torch.full(k_cache.shape[:-1], float("nan")))
    free = list(range(1, num_pages + 1))
    random.Random(seed).shuffle(free)
    page_table = torch.zeros(len(totals), max(pages_needed) + 1, dtype=torch.int32)
    dense_k, dense_v, positions = [], [], []
    for r, (total, need) in enumerate(zip(totals, pages_needed)):
        page_table[r, :need] = torch.tensor([free.pop() for _ in range(need)], dtype=torch.int32)
        k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(total)
        rows = page_table[r, pos // page_size].long() * page_size + pos % page_size
        write_kv(k_cache, v_cache, rows, k, v, *scales)
        dense_k.append(k)
        dense_v.append(v)
        positions.append(torch.arange(context_lens[r], total))
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(dtype)
    query_start = torch.zeros(len(totals) + 1, dtype=torch.int32)
    query_start[1:] = torch.tensor(query_lens).cumsum(0)
    if kv_cache_dtype == "fp8":
        return q, k_cache, v_cache, page_table, query_start, torch.cat(positions), dense_k, dense_v, scales
    return q, k_cache, v_cache, page_table, query_start, torch.cat(positions), dense_k, dense_v


CASES = [
    # page_size, heads, kv_heads, head_dim, query_lens, context_lens
    (16, 4, 2, 16, [1, 1, 1], [5, 0, 40]),  # decode
    (1, 4, 4, 16, [7, 1], [0, 9]),  # page size 1, prefill + decode mixed
    (4, 8, 2, 24, [5, 3, 1, 6], [3, 0, 13, 8]),  # head_dim not a power of two, chunk after context
    (16, 2, 1, 8, [33], [20]),  # long chunk across pages, MQA
    (16, 6, 2, 16, [9, 2], [0, 21]),  # 3 query heads a kv head: a prefill block's rows are not a power of two
    (8, 8, 1, 32, [40], [100]),  # a long context: the prefill's unmasked key blocks, then the causal ones
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_dense_causal_attention(case):
    page_size, heads, kv_heads, head_dim, qlens, clens = case
    q, kc, vc, pt, qs, pos, dense_k, dense_v = _scenario(0, page_size, heads, kv_heads, head_dim, qlens, clens)
    out = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5)
    for r, (qlen, ctx) in enumerate(zip(qlens, clens)):
        qr = q[qs[r] : qs[r + 1]].transpose(0, 1)  # [heads, q, d]
        k = dense_k[r].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = dense_v[r].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        mask = torch.ones(qlen, ctx + qlen, dtype=torch.bool).tril(diagonal=ctx)
        expected = torch.nn.functional.scaled_dot_product_attention(qr, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[qs[r] : qs[r + 1]], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all(), "poisoned pages outside the requests leaked into the output"


def _dequantized(x: torch.Tensor) -> torch.Tensor:
    values, scale = quantize_kv_rows(x)
    return values.float() * scale.unsqueeze(-1)


def test_fp8_rows_keep_their_amax_and_round_each_value_to_the_nearest_e4m3():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 24, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]
    x[5, 1] = 0.0  # an all-zero row: zero values, a finite scale
    values, scale = quantize_kv_rows(x.to(torch.bfloat16))
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64, 3)
    assert torch.isfinite(values.float()).all() and torch.isfinite(scale).all()
    amax = x.to(torch.bfloat16).float().abs().amax(-1)
    nonzero = amax > 0
    assert torch.equal(values.float().abs().amax(-1)[nonzero], torch.full_like(amax[nonzero], KV_FP8_MAX))
    assert (values[5, 1].float() == 0).all() and scale[5, 1] > 0
    # e4m3 keeps 3 mantissa bits: each value within half a step, 2^-4 of itself (above the subnormals)
    back = values.float() * scale.unsqueeze(-1)
    err = (back - x.to(torch.bfloat16).float()).abs()
    assert (err <= x.to(torch.bfloat16).float().abs() * 2**-4 + scale.unsqueeze(-1) * 2**-10).all()


@pytest.mark.parametrize("case", CASES)
def test_fp8_reference_is_attention_over_the_dequantized_rows(case):
    page_size, heads, kv_heads, head_dim, qlens, clens = case
    q, kc, vc, pt, qs, pos, dense_k, dense_v, (ks, vs) = _scenario(
        0, page_size, heads, kv_heads, head_dim, qlens, clens, kv_cache_dtype="fp8"
    )
    out = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5, ks, vs)
    plain = _scenario(0, page_size, heads, kv_heads, head_dim, qlens, clens)
    exact = paged_attention_reference(q, *plain[1:4], qlens, clens, head_dim**-0.5)
    for r, (qlen, ctx) in enumerate(zip(qlens, clens)):
        qr = q[qs[r] : qs[r + 1]].transpose(0, 1)
        k = _dequantized(dense_k[r]).repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = _dequantized(dense_v[r]).repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        mask = torch.ones(qlen, ctx + qlen, dtype=torch.bool).tril(diagonal=ctx)
        expected = torch.nn.functional.scaled_dot_product_attention(qr, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[qs[r] : qs[r + 1]], expected, rtol=1e-5, atol=1e-5)
    # and near attention over the unquantized rows: each K/V value within 2^-4 of itself
    assert (out - exact).abs().max() < 0.1
    assert torch.isfinite(out).all(), "poisoned pages or scales outside the requests leaked into the output"


def test_fp8_gather_dequantizes_into_the_buffer():
    cache = torch.tensor([1.0, 2.0, -4.0, 448.0, 0.5, -1.5], dtype=torch.float8_e4m3fn).reshape(3, 2, 1, 1)
    scales = torch.tensor([0.5, 0.25, 2.0, 1.0, 4.0, 8.0]).reshape(3, 2, 1)
    into = torch.full((3, 2, 1, 1), -7.0, dtype=torch.bfloat16)
    got = gather_request_kv(
        cache, torch.tensor([2, 0], dtype=torch.int32), 3, into=into, scales=scales, dtype=torch.bfloat16
    )
    assert got.dtype == torch.bfloat16 and got.data_ptr() == into.data_ptr()
    assert got.flatten().tolist() == [2.0, -12.0, 0.5] and into[2:].flatten().tolist() == [-7.0, -7.0]


def test_gather_reads_only_the_requests_pages():
    cache = torch.arange(5 * 2 * 1 * 1, dtype=torch.float32).reshape(5, 2, 1, 1)
    got = gather_request_kv(cache, torch.tensor([3, 1, 0], dtype=torch.int32), 3)
    assert got.flatten().tolist() == [6.0, 7.0, 2.0]
    into = torch.full((4, 2, 1, 1), -1.0)  # a destination with room: filled, and the rows are its storage
    held = gather_request_kv(cache, torch.tensor([3, 1, 0], dtype=torch.int32), 3, into=into)
    assert held.flatten().tolist() == [6.0, 7.0, 2.0] and held.data_ptr() == into.data_ptr()
    assert into[2:].flatten().tolist() == [-1.0] * 4
    small = torch.zeros(1, 2, 1, 1)  # without room: a fresh tensor, the destination untouched
    assert gather_request_kv(cache, torch.tensor([3, 1], dtype=torch.int32), 3, into=small).flatten().tolist() == [
        6.0,
        7.0,
        2.0,
    ] and small.flatten().tolist() == [0.0, 0.0]


DTYPES = [torch.float32, torch.bfloat16]
# (case, q dtype, KV pool): the model dtype's pool at both dtypes, and an fp8 pool (--kv-cache-dtype fp8) at the
# served bf16 and at float32
KERNEL_CASES = (
    [(case, dtype, "auto") for case in CASES for dtype in DTYPES]
    + [(case, torch.bfloat16, "fp8") for case in CASES]
    + [(CASES[2], torch.float32, "fp8")]
)


# The decode kernel runs (token, kv head, split) programs, DECODE_SPLITS of them a token, one by one under the
# interpreter: it takes each request's last DECODE_TOKENS tokens (several tokens of one request, and every request's
# full length, pages and key blocks kept), not a whole chunk's, whose other tokens take the same paths.
DECODE_TOKENS = 2


def _decode_lens(qlens: list[int], clens: list[int]) -> tuple[list[int], list[int]]:
    """(query lens, context lens) of the same requests' last DECODE_TOKENS tokens."""
    kept = [min(q, DECODE_TOKENS) for q in qlens]
    return kept, [c + q - k for q, c, k in zip(qlens, clens, kept)]


def test_the_decode_cases_keep_every_requests_length_and_several_tokens_of_one():
    for _, _, _, _, qlens, clens in CASES:
        kept, context = _decode_lens(qlens, clens)
        assert [q + c for q, c in zip(kept, context)] == [q + c for q, c in zip(qlens, clens)]
        assert all(0 < k <= q for k, q in zip(kept, qlens))
    assert max(q for case in CASES for q in _decode_lens(case[4], case[5])[0]) > 1


def _interpreted(kernel: str, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every (case, dtype, pool) through one interpreted kernel (decode or prefill), in one subprocess:
    (expected, out) pairs."""
    calls, expected = [], []
    for (page_size, heads, kv_heads, head_dim, qlens, clens), dtype, kv_cache_dtype in KERNEL_CASES:
        if kernel == "decode":
            qlens, clens = _decode_lens(qlens, clens)
        built = _scenario(seed, page_size, heads, kv_heads, head_dim, qlens, clens, dtype, kv_cache_dtype)
        q, kc, vc, pt, qs, pos = built[:6]
        ks, vs = built[8] if kv_cache_dtype == "fp8" else (None, None)
        expected.append(paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5, ks, vs))
        out = torch.full_like(q, float("nan"))  # every element must be written by the kernel
        scales = dict(k_scale=ks, v_scale=vs)
        if kernel == "decode":
            calls.append(((q, kc, vc, pt, qs, pos, head_dim**-0.5), dict(out=out, block_n=8, **scales)))
        else:
            calls.append(
                ((q, kc, vc, pt, qs, pos, qlens, head_dim**-0.5), dict(out=out, block_rows=16, block_n=16, **scales))
            )
    outs = run_interpreted("ferry.kernels.paged_attention_triton", f"paged_attention_{kernel}_triton", calls)
    return list(zip(expected, outs))


@pytest.fixture(scope="module")
def interpreted_runs():
    return {"decode": _interpreted("decode", seed=1), "prefill": _interpreted("prefill", seed=2)}


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
@pytest.mark.parametrize(
    "index", range(len(KERNEL_CASES)), ids=[f"{i}-{d}-{kv}" for i, (_, d, kv) in enumerate(KERNEL_CASES)]
)
def test_triton_kernel_matches_reference(kernel, index, interpreted_runs):
    expected, out = interpreted_runs[kernel][index]
    assert torch.isfinite(out).all()
    tol = 1e-5 if out.dtype == torch.float32 else 1e-2  # bf16: both round the same fp32 result once
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


def test_fp8_gather_kernel_matches_the_reference_gather():
    """FlashAttention's fp8 gather (kernels/kv_gather_triton.py, interpreted) against `gather_request_kv` with
    scales: the same float32 products (bf16: within the rounding, which the interpreter's bf16 cast does its own
    way), into the buffer where it has room (its tail untouched), else a new tensor."""
    calls, expected = [], []
    shapes = [(16, 2, 32, 37), (4, 1, 24, 9), (1, 3, 16, 5)]
    for seed, ((page_size, kv_heads, head_dim, length), dtype) in enumerate(
        [(shape, dtype) for shape in shapes for dtype in (torch.float32, torch.bfloat16)]
    ):
        _, kc, _, pt, *_, (ks, _) = _scenario(
            seed, page_size, 2 * kv_heads, kv_heads, head_dim, [length], [0], kv_cache_dtype="fp8"
        )
        pages = ceil_div(length, page_size)
        expected.append(gather_request_kv(kc, pt[0], length, scales=ks, dtype=dtype))
        into = torch.full((pages + 2, page_size, kv_heads, head_dim), -7.0, dtype=dtype)
        calls.append(((kc, ks, pt[0], length, dtype, into), {}))
        small = torch.full((1, page_size, kv_heads, head_dim), -7.0, dtype=dtype)
        calls.append(((kc, ks, pt[0], length, dtype, small), {}))  # no room: a new tensor
    outs = run_interpreted("tests.unit.kernels.kv_gather_entry", "gather_and_return_buffer", calls)
    for i, want in enumerate(expected):
        (held, buffer), (fresh, small) = outs[2 * i], outs[2 * i + 1]
        assert held.dtype == fresh.dtype == want.dtype
        tol = dict(rtol=0, atol=0) if want.dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
        torch.testing.assert_close(held, want, **tol)
        torch.testing.assert_close(fresh, want, **tol)
        want = held
        page_size = buffer.shape[1]
        assert torch.equal(buffer.flatten(0, 1)[: want.shape[0]], want), "not gathered into the buffer"
        assert (buffer[ceil_div(want.shape[0], page_size) :] == -7.0).all(), "written past the request's pages"
        assert (small == -7.0).all(), "a buffer without room was written"


def test_prefill_tiles_hold_a_kv_heads_query_heads_and_refuse_a_block_that_cannot():
    from ferry.kernels.paged_attention_triton import paged_attention_prefill_triton, prefill_tiles

    assert prefill_tiles(128, 8) == (64, 32, 8) and prefill_tiles(256, 8) == (64, 16, 4)
    assert prefill_tiles(64, 256)[0] == 256  # more query heads a kv head than rows: the rows grow
    q, kc, vc, pt, qs, pos, _, _ = _scenario(0, 4, 8, 2, 16, [5], [0])
    with pytest.raises(ValueError, match="block_rows"):
        paged_attention_prefill_triton(q, kc, vc, pt, qs, pos, [5], 0.25, block_rows=2)


def test_prefill_query_blocks_split_each_request():
    from ferry.kernels.paged_attention_triton import query_blocks

    assert query_blocks([3, 0, 20, 1], block_m=8) == ([0, 2, 2, 2, 3], [0, 3, 11, 19, 23])


def test_prefill_query_blocks_skip_the_requests_another_kernel_computes():
    from ferry.kernels.paged_attention_triton import query_blocks

    # request 2's rows still count for the rows after it: request 3's block starts at row 23
    assert query_blocks([3, 0, 20, 1], block_m=8, skip=frozenset({2})) == ([0, 3], [0, 23])


def test_prefill_kernel_leaves_skipped_requests_rows_alone():
    from ferry.kernels.paged_attention_triton import paged_attention_prefill_triton  # noqa: F401 (interpreted)

    qlens, clens = [40, 3, 9], [100, 5, 0]
    q, kc, vc, pt, qs, pos, _, _ = _scenario(3, 8, 8, 1, 32, qlens, clens)
    expected = paged_attention_reference(q, kc, vc, pt, qlens, clens, 32**-0.5)
    out = torch.full_like(q, 7.0)
    (got,) = run_interpreted(
        "ferry.kernels.paged_attention_triton",
        "paged_attention_prefill_triton",
        [((q, kc, vc, pt, qs, pos, qlens, 32**-0.5), dict(out=out, block_rows=16, block_n=16, skip=(0,)))],
    )
    assert (got[:40] == 7.0).all(), "a skipped request's rows were written"
    torch.testing.assert_close(got[40:], expected[40:], rtol=1e-5, atol=1e-5)


def test_flash_takes_long_queries_of_half_precision_cuda_steps_only():
    from ferry.kernels.paged_attention_flash import FLASH_MIN_QUERY_TOKENS, flash_available, flash_requests

    assert flash_requests([1, FLASH_MIN_QUERY_TOKENS, FLASH_MIN_QUERY_TOKENS - 1, 8192]) == [1, 3]
    assert not flash_available(torch.zeros(4, 16, 256, dtype=torch.bfloat16), torch.zeros(1, 16, 2, 256))  # on CPU


def test_flash_is_asked_what_the_lower_right_causal_bias_asks():
    """A chunk after a prompt's first has more keys than queries. FlashAttention refuses is_causal=True for
    such a non-square call (its causal flag is top-left there), so the pre-check must ask as SDPA's
    lower-right causal bias does, with the flag off and grouped-query heads on; with the flag on, every
    chunk but a prompt's first went to the paged kernel."""
    import torch.nn.attention.bias as bias
    from torch.nn.attention.bias import causal_lower_right

    from ferry.kernels.paged_attention_flash import flash_params

    query, key = torch.randn(1, 16, 8, 64), torch.randn(1, 2, 24, 64)
    params = flash_params(query, key, key)
    fields = lambda p: (p.is_causal, p.enable_gqa, p.attn_mask, p.dropout)  # noqa: E731
    assert fields(params) == (False, True, None, 0.0)
    # and what torch's own lower-right causal bias asks before it runs flash: the same question
    asked, real = [], bias.can_use_flash_attention
    bias.can_use_flash_attention = lambda p, *a: asked.append(p) or False  # CPU: on to SDPA's other paths
    try:
        torch.nn.functional.scaled_dot_product_attention(
            query, key, key, attn_mask=causal_lower_right(8, 24), enable_gqa=True
        )
    finally:
        bias.can_use_flash_attention = real
    assert [fields(p) for p in asked] == [fields(params)]


def test_a_long_query_flash_refuses_is_said_once_and_the_paged_kernel_computes_it(monkeypatch):
    """Where FlashAttention refuses a long query it was expected to take, the paged kernel computes the
    request (the same output) and the worker's log says so once per kind of call, not once per layer."""
    import structlog
    from structlog.testing import capture_logs

    from ferry.kernels import paged_attention as dispatch
    from ferry.kernels import paged_attention_triton

    q, kc, vc, pt, qs, pos, _, _ = _scenario(5, 16, 4, 2, 32, [130, 1], [40, 7])
    expected = paged_attention_reference(q, kc, vc, pt, [130, 1], [40, 7], 32**-0.5)
    skipped = []

    def paged_prefill(q_, k_, v_, pt_, qs_, pos_, qlens, scale, out, skip, k_scale, v_scale, sinks, window, ring_pages):
        assert k_scale is None and v_scale is None  # a pool of the model dtype (the kernel's twin stands in)
        assert sinks is None and window == 0 and ring_pages == 0  # full attention without sinks, as the scenario's
        skipped.append(skip)
        out.copy_(paged_attention_reference(q_, k_, v_, pt_, qlens, [40, 7], scale))
        return out

    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(dispatch, "flash_available", lambda q_, k_: True)
    monkeypatch.setattr(dispatch, "flash_prefill_into", lambda *a, **scales: False)
    monkeypatch.setattr(paged_attention_triton, "paged_attention_prefill_triton", paged_prefill)
    monkeypatch.setattr(dispatch, "_refusals_logged", set())
    with capture_logs() as logs:
        # a logger first used inside the capture (the configured one may have cached its processors)
        monkeypatch.setattr(dispatch, "log", structlog.get_logger("worker.attention"))
        for _ in range(3):  # three layers of one step
            out = dispatch.paged_attention(q, kc, vc, pt, qs, pos, [130, 1], [40, 7], 32**-0.5)
    torch.testing.assert_close(out, expected)
    assert skipped == [frozenset()] * 3, "the refused request was left to nobody"
    refused = [e for e in logs if e["event"] == "flash_attention_refused"]
    assert len(refused) == 1 and refused[0]["query_tokens"] == 130 and refused[0]["context_tokens"] == 40
    assert refused[0]["log_level"] == "warning"


def test_triton_token_requests_follow_query_start():
    from ferry.kernels.paged_attention_triton import token_requests  # plain torch: no kernel launch

    qs = torch.tensor([0, 2, 3, 3, 7], dtype=torch.int32)  # request 2 has no new tokens
    assert token_requests(qs, 7).tolist() == [0, 0, 1, 3, 3, 3, 3]


# Sinks and sliding windows (gpt-oss): (case, window); windows shorter than a key block, than a page, than the
# chunk, longer than some contexts, and one longer than every request
WINDOW_CASES = [(CASES[0], 4), (CASES[2], 5), (CASES[3], 8), (CASES[5], 37), (CASES[4], 1000)]


def _sinks(heads: int, seed: int) -> torch.Tensor:
    return 2.0 * torch.randn(heads, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case,window", WINDOW_CASES)
def test_reference_with_sinks_and_a_window_is_transformers_eager_attention(case, window):
    """transformers' gpt-oss eager attention: the window's mask (keys past position - window), the sink logit
    concatenated to each row's scores, softmaxed, and dropped."""
    page_size, heads, kv_heads, head_dim, qlens, clens = case
    q, kc, vc, pt, qs, pos, dense_k, dense_v = _scenario(0, page_size, heads, kv_heads, head_dim, qlens, clens)
    sinks = _sinks(heads, 1)
    out = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5, sinks=sinks, window=window)
    for r, (qlen, ctx) in enumerate(zip(qlens, clens)):
        qr = q[qs[r] : qs[r + 1]].transpose(0, 1)
        k = dense_k[r].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = dense_v[r].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        query_pos, key_pos = torch.arange(ctx, ctx + qlen)[:, None], torch.arange(ctx + qlen)[None, :]
        allowed = (key_pos <= query_pos) & (key_pos > query_pos - window)
        scores = (qr @ k.transpose(1, 2)) * head_dim**-0.5 + torch.where(allowed, 0.0, float("-inf"))
        logits = torch.cat([scores, sinks[:, None, None].expand(heads, qlen, 1)], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        torch.testing.assert_close(out[qs[r] : qs[r + 1]], (probs @ v).transpose(0, 1), rtol=1e-5, atol=1e-5)
    plain = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5)
    assert not torch.allclose(out, plain, atol=1e-3), "the sinks (and window) changed nothing"


def _interpreted_windowed(kernel: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    calls, expected = [], []
    for i, ((page_size, heads, kv_heads, head_dim, qlens, clens), window) in enumerate(WINDOW_CASES):
        for dtype in (torch.float32, torch.bfloat16):
            if kernel == "decode":
                qlens, clens = _decode_lens(qlens, clens)
            q, kc, vc, pt, qs, pos = _scenario(i, page_size, heads, kv_heads, head_dim, qlens, clens, dtype)[:6]
            sinks = _sinks(heads, i).to(dtype)
            extra = dict(sinks=sinks, window=window)
            expected.append(paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5, **extra))
            out = torch.full_like(q, float("nan"))
            if kernel == "decode":
                calls.append(((q, kc, vc, pt, qs, pos, head_dim**-0.5), dict(out=out, block_n=8, **extra)))
            else:
                args = (q, kc, vc, pt, qs, pos, qlens, head_dim**-0.5)
                calls.append((args, dict(out=out, block_rows=16, block_n=16, **extra)))
    outs = run_interpreted("ferry.kernels.paged_attention_triton", f"paged_attention_{kernel}_triton", calls)
    return list(zip(expected, outs))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_triton_kernels_with_sinks_and_a_window_match_the_reference(kernel):
    for expected, out in _interpreted_windowed(kernel):
        assert torch.isfinite(out).all()
        tol = 1e-5 if out.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


# A sliding group kept in rings (plan/kv_groups.py): (case, window), the ring as small as the case's longest chunk
# allows, so the oldest positions of every request have been overwritten by newer ones
RING_CASES = [(CASES[1], 3), (CASES[2], 5), (CASES[3], 8), (CASES[5], 37), (CASES[0], 4)]


def _ring_scenario(
    seed, page_size, heads, kv_heads, head_dim, qlens, clens, window, dtype=torch.float32, pages_short=0
):
    """_scenario's requests, their K/V also written position by position into rings of shuffled slots (the rest of
    the rings NaN), `pages_short` pages fewer than the chunks need: (q, paged K, paged V, page table, query_start,
    positions, ring K, ring V, slots, ring pages)."""
    q, kc, vc, pt, qs, pos, dense_k, dense_v = _scenario(
        seed, page_size, heads, kv_heads, head_dim, qlens, clens, dtype
    )
    pages = ring_pages(window, max(qlens), page_size) - pages_short
    slots = list(range(1, len(qlens) + 3))
    random.Random(seed).shuffle(slots)
    slots = torch.tensor(slots[: len(qlens)], dtype=torch.int64)
    ring_k = torch.full(((len(qlens) + 3) * pages, page_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    ring_v = torch.full_like(ring_k, float("nan"))
    for r, (k, v) in enumerate(zip(dense_k, dense_v)):
        positions = torch.arange(k.shape[0])
        rows = ring_rows(positions, slots[r].expand(k.shape[0]), pages, page_size)
        write_kv(ring_k, ring_v, rows, k, v)
    return q, kc, vc, pt, qs, pos, ring_k, ring_v, slots, pages


@pytest.mark.parametrize("case,window", RING_CASES)
def test_reference_reads_a_ring_as_the_same_keys_paged(case, window):
    page_size, heads, kv_heads, head_dim, qlens, clens = case
    q, kc, vc, pt, qs, pos, rk, rv, slots, pages = _ring_scenario(0, *case, window)
    assert pages * page_size < max(q + c for q, c in zip(qlens, clens)), "the ring has wrapped"
    sinks = _sinks(heads, 2)
    paged = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5, sinks=sinks, window=window)
    ring = paged_attention_reference(
        q, rk, rv, slots, qlens, clens, head_dim**-0.5, sinks=sinks, window=window, ring_pages=pages
    )
    assert torch.isfinite(ring).all()
    torch.testing.assert_close(ring, paged, rtol=0, atol=0)


def test_a_ring_one_page_short_loses_keys_of_the_window():
    """The ring's size is what keeps the window: one page fewer and a chunk's new keys overwrite its oldest."""
    case, window = RING_CASES[2]
    page_size, heads, kv_heads, head_dim, qlens, clens = case
    q, kc, vc, pt, qs, pos, _, _, _, pages = _ring_scenario(0, *case, window)
    paged = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5, window=window)
    q, _, _, _, _, _, rk, rv, slots, short = _ring_scenario(0, *case, window, pages_short=1)
    assert short == pages - 1
    ring = paged_attention_reference(q, rk, rv, slots, qlens, clens, head_dim**-0.5, window=window, ring_pages=short)
    assert not torch.allclose(ring, paged, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_triton_kernels_read_a_ring_as_the_reference(kernel):
    calls, expected = [], []
    for i, ((page_size, heads, kv_heads, head_dim, qlens, clens), window) in enumerate(RING_CASES):
        for dtype in (torch.float32, torch.bfloat16):
            if kernel == "decode":
                qlens, clens = _decode_lens(qlens, clens)
            case = (page_size, heads, kv_heads, head_dim, qlens, clens)
            q, _, _, _, qs, pos, rk, rv, slots, pages = _ring_scenario(i, *case, window, dtype=dtype)
            extra = dict(sinks=_sinks(heads, i).to(dtype), window=window, ring_pages=pages)
            expected.append(paged_attention_reference(q, rk, rv, slots, qlens, clens, head_dim**-0.5, **extra))
            out = torch.full_like(q, float("nan"))
            if kernel == "decode":
                calls.append(((q, rk, rv, slots, qs, pos, head_dim**-0.5), dict(out=out, block_n=8, **extra)))
            else:
                args = (q, rk, rv, slots, qs, pos, qlens, head_dim**-0.5)
                calls.append((args, dict(out=out, block_rows=16, block_n=16, **extra)))
    outs = run_interpreted("ferry.kernels.paged_attention_triton", f"paged_attention_{kernel}_triton", calls)
    for want, out in zip(expected, outs):
        assert torch.isfinite(out).all()
        tol = 1e-5 if out.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
