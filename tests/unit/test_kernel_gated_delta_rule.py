"""Gated delta rule twins: recurrent (the definition) and chunked agree; a sequence split into
segments continues from the carried state; and both match transformers' own torch fallback,
an independent implementation of the same rule."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from ferry.kernels.gated_delta_rule import gated_delta_rule_varlen
from ferry.kernels.gated_delta_rule_reference import gated_delta_rule_chunked, gated_delta_rule_recurrent


def _inputs(length, k_heads, v_heads, k_dim, v_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, k_heads, k_dim, generator=g)
    k = torch.randn(length, k_heads, k_dim, generator=g)
    v = torch.randn(length, v_heads, v_dim, generator=g)
    decay = -torch.rand(length, v_heads, generator=g) * 2
    beta = torch.rand(length, v_heads, generator=g)
    state = torch.randn(v_heads, k_dim, v_dim, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("length,chunk", [(1, 64), (9, 4), (70, 16), (64, 64)])
@pytest.mark.parametrize("heads", [(2, 2), (2, 4)])
def test_chunked_matches_recurrent(length, chunk, heads):
    q, k, v, g, beta, s0 = _inputs(length, heads[0], heads[1], 8, 16)
    out_r, s_r = gated_delta_rule_recurrent(q, k, v, g, beta, s0)
    out_c, s_c = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=chunk)
    torch.testing.assert_close(out_c, out_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_c, s_r, rtol=1e-4, atol=1e-5)


def test_segments_continue_from_state():
    q, k, v, g, beta, s0 = _inputs(30, 2, 4, 8, 8, seed=1)
    whole, s_whole = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=8)
    first, s_mid = gated_delta_rule_chunked(q[:11], k[:11], v[:11], g[:11], beta[:11], s0, chunk_size=8)
    second, s_end = gated_delta_rule_recurrent(q[11:], k[11:], v[11:], g[11:], beta[11:], s_mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_end, s_whole, rtol=1e-4, atol=1e-5)


def test_matches_transformers_fallback():
    q, k, v, g, beta, s0 = _inputs(70, 2, 4, 8, 16, seed=2)
    ours, s_ours = gated_delta_rule_chunked(q, k, v, g, beta, s0)
    ref, s_ref = torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g=g[None],
        beta=beta[None],
        initial_state=s0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(ours, ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_ours, s_ref[0], rtol=1e-4, atol=1e-5)


def test_varlen_updates_only_batch_slots_in_place():
    q, k, v, g, beta, _ = _inputs(8, 2, 4, 8, 8, seed=3)
    states = torch.full((5, 4, 8, 8), float("nan"))
    states[2] = torch.randn(4, 8, 8)
    states[4] = 0
    before = states.clone()
    query_start = torch.tensor([0, 7, 8], dtype=torch.int32)
    out = gated_delta_rule_varlen(q, k, v, g, beta, states, torch.tensor([4, 2]), query_start, [7, 1])
    exp_a, s_a = gated_delta_rule_chunked(q[:7], k[:7], v[:7], g[:7], beta[:7], before[4])
    exp_b, s_b = gated_delta_rule_recurrent(q[7:], k[7:], v[7:], g[7:], beta[7:], before[2])
    torch.testing.assert_close(out, torch.cat([exp_a, exp_b]))
    torch.testing.assert_close(states[4], s_a)
    torch.testing.assert_close(states[2], s_b)
    for untouched in (0, 1, 3):
        assert torch.isnan(states[untouched]).all()


def test_keeping_a_state_inside_a_row_gives_the_same_outputs_and_the_state_there():
    """gated_delta_rule_varlen_keeping: three rows, two keeping their state inside their chunk (after 5 of
    12 tokens, after 16 of 17), one not: the outputs and final states are those of the plain varlen call,
    and each kept state is the state after that row's first n tokens, from the same initial state."""
    from ferry.kernels.gated_delta_rule import gated_delta_rule_varlen_keeping

    lens, inside = [12, 4, 17], [(0, 5), (2, 16)]
    q, k, v, g, beta, _ = _inputs(sum(lens), 2, 4, 8, 16, seed=3)
    states = torch.randn(4, 4, 8, 16, generator=torch.Generator().manual_seed(4))
    slots = torch.tensor([3, 1, 2])
    qstart = torch.tensor([0, 12, 16, 33], dtype=torch.int32)
    plain_states = states.clone()
    plain = gated_delta_rule_varlen(q, k, v, g, beta, plain_states, slots, qstart, lens)
    kept_states = states.clone()
    out, kept = gated_delta_rule_varlen_keeping(
        q, k, v, g, beta, kept_states, slots, qstart, lens, inside, slots.tolist()
    )
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kept_states, plain_states, rtol=1e-4, atol=1e-5)
    starts = [0, 12, 16]
    for (row, n), state in zip(inside, kept):
        a = starts[row]
        _, want = gated_delta_rule_chunked(
            q[a : a + n], k[a : a + n], v[a : a + n], g[a : a + n], beta[a : a + n], states[int(slots[row])]
        )
        torch.testing.assert_close(state, want, rtol=1e-4, atol=1e-5)
    # nothing inside: the plain call, and no states kept
    again, none = gated_delta_rule_varlen_keeping(
        q, k, v, g, beta, states.clone(), slots, qstart, lens, [], slots.tolist()
    )
    torch.testing.assert_close(again, plain)
    assert none == []


def test_the_q_k_normalisation_ferry_does_before_fla_is_transformers_one_in_float32():
    # fla's chunked rule gets q and k normalised (its own l2norm kernel autotunes on tokens x heads, inside
    # requests): transformers' twin of fla's in-kernel l2norm, in float32, back in bfloat16, of unit length
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm as transformers_l2norm

    from ferry.kernels.gated_delta_rule import _l2norm

    x = (torch.randn(37, 4, 128) * 3).to(torch.bfloat16)
    got = _l2norm(x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got, transformers_l2norm(x.float()).to(torch.bfloat16), atol=0, rtol=0)
    torch.testing.assert_close(got.float().norm(dim=-1), torch.ones(37, 4), atol=1e-2, rtol=0)


def test_fla_chunk_list_is_made_from_the_host_lengths():
    """chunk_indices: each 64-token chunk's request and its index in that request (fla's layout; the CUDA
    test holds it to fla's own prepare_chunk_indices), a request of 0 tokens having none; kept for the
    step's next linear layer."""
    from ferry.kernels.gated_delta_rule import FLA_CHUNK, chunk_indices

    assert FLA_CHUNK == 64
    got = chunk_indices([1, 64, 65, 130, 0, 3], torch.device("cpu"))
    assert got.dtype == torch.int64
    assert got.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2], [5, 0]]
    assert chunk_indices([1, 64, 65, 130, 0, 3], torch.device("cpu")) is got
    assert chunk_indices([8192], torch.device("cpu")).tolist() == [[0, i] for i in range(128)]


def test_the_chunk_lists_of_a_sliced_steps_slices_are_kept_side_by_side():
    """A step whose mixers run in slices (services/worker/mixer_slices.py) asks for its slices' lists in turn in
    every linear layer: each is made once, and only the least recently used of more than a few is let go."""
    from ferry.kernels.gated_delta_rule import _CHUNK_INDICES_KEPT, chunk_indices

    cpu = torch.device("cpu")
    slices = [[4500], [4400, 100]]
    first = [chunk_indices(lens, cpu) for lens in slices]
    for _ in range(3):  # three more layers
        assert all(chunk_indices(lens, cpu) is made for lens, made in zip(slices, first))
    for n in range(_CHUNK_INDICES_KEPT - 1):  # as many others as leave the last used of the two kept
        chunk_indices([n + 1], cpu)
    assert chunk_indices([4400, 100], cpu) is first[1]
    assert chunk_indices([4500], cpu) is not first[0]
