"""Causal conv1d with carried state: any split of a sequence into chunks (even chunks shorter than
the state) gives the outputs of one causal conv over the whole sequence, and the state is the
last kernel-1 inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferry.kernels.causal_conv1d import causal_conv1d_decode, causal_conv1d_varlen, causal_conv1d_with_state


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
    state, x, weight = torch.randn(channels, kernel - 1, generator=g), torch.randn(10, channels, generator=g), torch.randn(channels, kernel, generator=g)
    _, want = causal_conv1d_with_state(x[:n], state, weight)
    assert torch.equal(conv_state_after(state, x[:n], kernel), want)
