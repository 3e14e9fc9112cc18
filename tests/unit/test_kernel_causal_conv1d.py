"""Causal conv1d with carried state: any split of a sequence into chunks (even chunks shorter than
the state) gives the outputs of one causal conv over the whole sequence, and the state is the
last kernel-1 inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted_triton import run_interpreted

from ferry.kernels.causal_conv1d import causal_conv1d_decode, causal_conv1d_varlen, causal_conv1d_with_state
from ferry.kernels.causal_conv1d_reference import causal_conv1d_varlen_reference


def _whole_sequence(x, weight):
    channels, kernel = weight.shape
    out = F.conv1d(x.t()[None], weight[:, None, :], padding=kernel - 1, groups=channels)[0, :, : x.shape[0]]
    return F.silu(out).t()


@pytest.mark.parametrize("splits", [[13], [1, 1, 1, 10], [2, 5, 6], [6, 1, 6]])
@pytest.mark.parametrize("kernel", [2, 4])
def test_chunks_continue_from_state(splits, kernel):
    g = torch.Generator().manual_seed(kernel)
    x = torch.randn(sum(splits), 6, generator=g)
    weight = torch.randn(6, kernel, generator=g)
    state = torch.zeros(6, kernel - 1)
    outs, start = [], 0
    for n in splits:
        out, state = causal_conv1d_with_state(x[start : start + n], state, weight)
        outs.append(out)
        start += n
    torch.testing.assert_close(torch.cat(outs), _whole_sequence(x, weight), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, x[-(kernel - 1) :].t())


def test_varlen_touches_only_the_batch_slots():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 4, generator=g)
    states = torch.full((4, 5, 3), float("nan"))
    states[1] = 0
    states[3] = torch.randn(5, 3, generator=g)
    before = states.clone()
    x = torch.randn(7, 5, generator=g)
    out = causal_conv1d_varlen(x, states, [3, 1], [4, 3], weight)
    expected_a, state_a = causal_conv1d_with_state(x[:4], before[3], weight)
    expected_b, state_b = causal_conv1d_with_state(x[4:], before[1], weight)
    torch.testing.assert_close(out, torch.cat([expected_a, expected_b]))
    torch.testing.assert_close(states[3], state_a)
    torch.testing.assert_close(states[1], state_b)
    assert torch.isnan(states[0]).all() and torch.isnan(states[2]).all()


def test_batched_decode_matches_per_request():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(5, 4, generator=g)
    states = torch.full((5, 5, 3), float("nan"))
    states[[1, 2, 4]] = torch.randn(3, 5, 3, generator=g)
    x = torch.randn(3, 5, generator=g)
    slots = torch.tensor([4, 1, 2])
    expected_states = states.clone()
    expected = causal_conv1d_varlen(x, expected_states, [4, 1, 2], [1, 1, 1], weight)
    out = causal_conv1d_decode(x, states, slots, weight)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(states, expected_states, equal_nan=True)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_the_state_after_a_chunks_first_inputs_is_the_state_a_chunk_ending_there_leaves(n):
    """conv_state_after (a snapshot kept inside a chunk) against causal_conv1d_with_state on those inputs,
    including chunks shorter than the kernel's memory."""
    from ferry.kernels.causal_conv1d import conv_state_after

    g = torch.Generator().manual_seed(n)
    channels, kernel = 6, 4
    state, x, weight = (
        torch.randn(channels, kernel - 1, generator=g),
        torch.randn(10, channels, generator=g),
        torch.randn(channels, kernel, generator=g),
    )
    _, want = causal_conv1d_with_state(x[:n], state, weight)
    assert torch.equal(conv_state_after(state, x[:n], kernel), want)


def _prefill_case(seed, query_lens, channels, kernel, dtype, state_dtype):
    """A step's inputs as the model hands them: x a strided view (q/k/v of the in_proj output), the
    requests' slots shuffled, every other slot poisoned."""
    g = torch.Generator().manual_seed(seed)
    t = sum(query_lens)
    wide = torch.randn(t, channels + 7, generator=g).to(dtype)
    x = wide[:, 3 : 3 + channels]
    weight = (torch.randn(channels, kernel, generator=g) * 0.5).to(dtype)
    slots = torch.randperm(len(query_lens) + 3, generator=g)[: len(query_lens)] + 1
    states = torch.full((len(query_lens) + 4, channels, kernel - 1), float("nan"), dtype=state_dtype)
    states[slots] = torch.randn(len(query_lens), channels, kernel - 1, generator=g).to(state_dtype)
    start = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    start[1:] = torch.tensor(query_lens).cumsum(0)
    return x, states, slots, start, weight


# requests shorter than the state (1, 2 tokens at kernel 4), and at a block boundary (32, 33)
PREFILL_CASES = [([5], 4), ([1, 2, 40, 3], 4), ([33, 1, 32, 2], 4), ([7, 9], 2), ([70], 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens,kernel", PREFILL_CASES)
def test_prefill_kernel_matches_its_twin(query_lens, kernel, dtype):
    """The Triton prefill conv (interpreted) against the per-request torch twin: the outputs, each
    request's new state, and every other slot untouched (NaN stays NaN)."""
    channels = 136  # one full block of 128 channels and a ragged one
    x, states, slots, start, weight = _prefill_case(
        len(query_lens) + kernel, query_lens, channels, kernel, dtype, dtype
    )
    want_states = states.clone()
    want = causal_conv1d_varlen_reference(x, want_states, slots.tolist(), query_lens, weight)
    [(got, got_states)] = run_interpreted(
        "tests.unit.interpreted_causal_conv1d", "prefill", [((x, states, slots, start, max(query_lens), weight), {})]
    )
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_states, want_states, equal_nan=True, rtol=0, atol=0)


def test_prefill_dispatch_keeps_the_twin_off_cuda_and_without_the_device_lists(monkeypatch):
    """Off CUDA, or without the step's slots and first rows on the device, the twin computes (it takes bias too)."""
    x, states, slots, start, weight = _prefill_case(0, [3, 4], 8, 4, torch.float32, torch.float32)
    want_states = states.clone()
    want = causal_conv1d_varlen_reference(x, want_states, slots.tolist(), [3, 4], weight)
    got = causal_conv1d_varlen(x, states, slots.tolist(), [3, 4], weight, slots_on_device=slots, query_start=start)
    assert torch.equal(got, want) and torch.equal(states.nan_to_num(), want_states.nan_to_num())
    # with the device lists missing, even where Triton would run, the twin computes (host lists only)
    import ferry.kernels.causal_conv1d as conv

    x2, states2, slots2, _, weight2 = _prefill_case(1, [2, 5], 8, 4, torch.float32, torch.float32)
    want2_states = states2.clone()
    want2 = causal_conv1d_varlen_reference(x2, want2_states, slots2.tolist(), [2, 5], weight2)
    monkeypatch.setattr(conv, "use_triton", lambda t: True)
    got2 = causal_conv1d_varlen(x2, states2, slots2.tolist(), [2, 5], weight2)
    assert torch.equal(got2, want2) and torch.equal(states2.nan_to_num(), want2_states.nan_to_num())
