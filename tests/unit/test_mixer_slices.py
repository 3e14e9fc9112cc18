"""A long step's token mixers run over slices of its tokens (services/worker/mixer_slices.py): the slices are the
steps a scheduler would have cut, and a sliced forward computes what the whole one does, float32 on CPU, against
the unsliced forward and transformers; snapshots kept inside a chunk land in the slice they fall in."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_harness import PagedRunner, assert_logits_close, hf_greedy
from test_hybrid_prefix_parity import Engine, _prompt
from tiny_models import tiny_model

from ferry.plan.costs import MIXER_SLICE_TOKENS, workspace_bytes_estimate
from ferry.plan.model_config import load_model_config
from ferry.services.worker import forward_batch
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.mixer_slices import mixer_slices, slice_bounds
from ferry.shared.step import StepBatch
from tests.helpers import QWEN3_6_35B

PS = 4


def _step(query_lens, context_lens=None, reset=None, save=None) -> StepBatch:
    """A step whose rows own pages 1.. in order; `save`: {row: (snapshot, offset)} kept inside the row."""
    q = np.asarray(query_lens, np.int32)
    c = np.zeros(len(q), np.int32) if context_lens is None else np.asarray(context_lens, np.int32)
    pages = -(-(q + c) // PS)
    table = np.zeros((len(q), int(pages.max())), np.int32)
    first = 1
    for i, n in enumerate(pages):
        table[i, :n] = np.arange(first, first + n)
        first += int(n)
    save_state = save_offset = None
    if save:
        save_state = np.full(len(q), -1, np.int32)
        save_offset = q.copy()
        for row, (snapshot, offset) in save.items():
            save_state[row], save_offset[row] = snapshot, offset
    return StepBatch(
        step_id=7,
        req_ids=np.arange(10, 10 + len(q), dtype=np.int64),
        tokens=np.arange(int(q.sum()), dtype=np.int32) % 90,
        query_lens=q,
        context_lens=c,
        page_table=table,
        linear_state_slots=np.arange(1, len(q) + 1, dtype=np.int32),
        reset_linear_state=np.ones(len(q), bool) if reset is None else np.asarray(reset, bool),
        sample=np.ones(len(q), bool),
        save_state=save_state,
        save_offset=save_offset,
    )


def test_a_step_within_the_slice_is_not_cut():
    assert mixer_slices(_step([10, 6]), 16) == []


def test_ring_slices_cut_a_step_only_where_a_row_is_longer_than_the_slice():
    """A sliding ring bounds each request's tokens in a slice (plan/kv_groups.py): a decode step of many one-token
    rows is never cut, however many; a row longer than the slice cuts the whole step in slices of at most it."""
    assert mixer_slices(_step([1] * 40), 16, rows_only=True) == []
    assert mixer_slices(_step([10, 6, 16]), 16, rows_only=True) == []
    slices = mixer_slices(_step([1, 20, 1, 1]), 16, rows_only=True)
    assert [(a, b) for a, b, _ in slices] == [(0, 11), (11, 23)]
    assert [s.query_lens.tolist() for _, _, s in slices] == [[1, 10], [10, 1, 1]]
    assert [s.context_lens.tolist() for _, _, s in slices] == [[0, 0], [10, 0, 0]]


def test_rows_cut_by_a_slice_continue_in_the_next_from_their_context():
    step = _step([5, 40, 3], context_lens=[0, 8, 2], reset=[True, True, False])
    slices = mixer_slices(step, 16)
    assert [(a, b) for a, b, _ in slices] == [(0, 16), (16, 32), (32, 48)]
    parts = [
        (
            s.req_ids.tolist(),
            s.query_lens.tolist(),
            s.context_lens.tolist(),
            s.reset_linear_state.tolist(),
            s.linear_state_slots.tolist(),
        )
        for _, _, s in slices
    ]
    assert parts == [
        ([10, 11], [5, 11], [0, 8], [True, True], [1, 2]),
        ([11], [16], [19], [False], [2]),  # the row's tokens 11..26, after its 8 of context and 11 of the step
        ([11, 12], [13, 3], [35, 2], [False, False], [2, 3]),
    ]
    assert not any(s.sample.any() for _, _, s in slices)
    assert np.concatenate([s.tokens for _, _, s in slices]).tolist() == step.tokens.tolist()


def test_slices_write_and_read_the_rows_the_whole_step_does():
    rng = np.random.default_rng(3)
    for _ in range(200):
        rows = int(rng.integers(1, 6))
        step = _step(rng.integers(1, 40, rows), context_lens=rng.integers(0, 30, rows))
        whole = ForwardBatch.from_step(step, PS, "cpu")
        limit = int(rng.integers(2, 24))
        slices = mixer_slices(step, limit)
        if int(step.query_lens.sum()) <= limit:
            assert slices == []
            continue
        assert all(b - a <= limit for a, b, _ in slices)
        parts = [ForwardBatch.from_step(s, PS, "cpu") for _, _, s in slices]
        for name in ("positions", "slot_mapping", "tokens"):
            assert torch.cat([getattr(p, name) for p in parts]).tolist() == getattr(whole, name).tolist(), name
        # every new token attends to its own request's pages
        owners = torch.cat([torch.from_numpy(s.req_ids)[p.token_request.long()] for (_, _, s), p in zip(slices, parts)])
        assert owners.tolist() == torch.from_numpy(step.req_ids)[whole.token_request.long()].tolist()


def test_a_cut_never_falls_on_a_point_kept_inside_a_chunk(monkeypatch):
    # row 1 keeps its state after 6 of its tokens: token 11 of the step, where the first of three even cuts
    # of its 35 tokens would fall
    step = _step([5, 30], save={1: (4, 6)})
    assert slice_bounds(step, 16) == [(0, 10), (10, 23), (23, 35)]
    slices = mixer_slices(step, 16)
    kept = [
        (
            s.req_ids[s.saved_inside()].tolist(),
            s.save_state[s.saved_inside()].tolist(),
            s.save_offset[s.saved_inside()].tolist(),
        )
        for _, _, s in slices
    ]
    assert kept == [([], [], []), ([11], [4], [1]), ([], [], [])]  # after the slice's first token of the row
    monkeypatch.setattr(forward_batch, "MIXER_SLICE_TOKENS", 16)
    batch = ForwardBatch.from_step(step, PS, "cpu")
    assert [p.inside_saves for _, _, p in batch.mixer_slices] == [(), ((0, 1, 4),), ()]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        slice_bounds(step, 1)


def test_several_rows_keep_their_states_in_the_slices_they_fall_in():
    # three rows keep their states inside their chunks, at tokens 2, 15 and 30 of the step: the last two on the
    # even cuts of its 45 tokens, which move a token earlier
    step = _step([5, 20, 20], save={0: (3, 2), 1: (4, 10), 2: (5, 5)})
    assert slice_bounds(step, 16) == [(0, 14), (14, 29), (29, 45)]
    kept = sorted(
        (int(s.req_ids[r]), int(s.save_state[r]), int(s.save_offset[r]), a)
        for a, _, s in mixer_slices(step, 16)
        for r in np.flatnonzero(s.saved_inside())
    )
    assert kept == [(10, 3, 2, 0), (11, 4, 1, 14), (12, 5, 1, 29)]


def test_a_slice_of_one_token_rows_takes_them_as_a_decode_step_would():
    step = _step([15] + [1] * 15, context_lens=[0] + [9] * 15, reset=[True] + [True, False] * 7 + [True])
    (a, b, first), (c, d, rest) = mixer_slices(step, 16)
    assert (a, b, c, d) == (0, 15, 15, 30) and first.query_lens.tolist() == [15]
    assert rest.query_lens.tolist() == [1] * 15 and rest.context_lens.tolist() == [9] * 15
    assert rest.reset_linear_state.tolist() == step.reset_linear_state[1:].tolist()


def test_only_long_steps_get_slices_of_the_plans_size():
    assert ForwardBatch.from_step(_step([MIXER_SLICE_TOKENS]), PS, "cpu").mixer_slices == ()
    long = ForwardBatch.from_step(_step([MIXER_SLICE_TOKENS + 5, 3]), PS, "cpu")
    half = (MIXER_SLICE_TOKENS + 8) // 2  # even slices: no 8-token tail
    assert [(a, b, p.num_tokens) for a, b, p in long.mixer_slices] == [(0, half, half), (half, 2 * half, half)]


@pytest.fixture(params=["qwen3_moe", "qwen3_5_moe", "qwen3_next"])
def model(request):
    return tiny_model(request.param, seed=5)


def _runner(model, slice_tokens, monkeypatch, cuts: list | None = None, **kw) -> PagedRunner:
    """A runner whose steps' mixers run in slices of `slice_tokens`; `cuts` collects each sliced step's bounds."""
    hf, spec = model
    monkeypatch.setattr(forward_batch, "MIXER_SLICE_TOKENS", slice_tokens)
    if cuts is not None:

        def spy(step, max_tokens, rows_only=False):
            made = mixer_slices(step, max_tokens, rows_only)
            if made:
                cuts.append([(a, b) for a, b, _ in made])
            return made

        monkeypatch.setattr(forward_batch, "mixer_slices", spy)
    return PagedRunner(spec, hf, page_size=PS, seed=1, **kw)


def test_a_sliced_step_computes_what_the_whole_step_does(model, monkeypatch):
    hf, _ = model
    prompts = {1: _prompt(30, 1), 2: _prompt(7, 2), 3: _prompt(21, 3)}
    got, cuts = {}, []
    for slice_tokens in (16, 10_000):
        runner = _runner(model, slice_tokens, monkeypatch, cuts)
        first = runner.step([(1, prompts[1][:9]), (2, prompts[2])])  # a row continuing from its context
        # 42 tokens and two padding rows: slices of 14, 15, 15, row 3 starting in the second
        second = runner.step([(1, prompts[1][9:]), (3, prompts[3])], padding=2)
        got[slice_tokens] = first + second
    assert cuts == [[(0, 14), (14, 29), (29, 44)]]  # sliced only under the small slice, only the long step
    for ours, whole in zip(got[16], got[10_000]):
        assert_logits_close(ours, whole)  # float32 noise: the same as a prompt cut into two steps


def test_one_token_rows_sliced_apart_continue_and_start_as_in_the_whole_step(model, monkeypatch):
    """A slice made only of one-token rows (the Gated DeltaNet and attention take it as a decode step), seven
    continuing requests and eight starting ones, after the slice of a 15-token row: 30 tokens, cut at 15."""
    prompts = {r: _prompt(15 if r == 1 else 6, r) for r in range(1, 17)}
    got, cuts = {}, []
    for slice_tokens in (16, 10_000):
        runner = _runner(model, slice_tokens, monkeypatch, cuts, num_slots=20)
        runner.step([(r, prompts[r][:5]) for r in range(2, 9)])  # seven requests with context
        items = [
            (1, prompts[1]),
            *((r, prompts[r][5:6]) for r in range(2, 9)),
            *((r, prompts[r][:1]) for r in range(9, 17)),
        ]
        got[slice_tokens] = runner.step(items)
    assert cuts[-1] == [(0, 15), (15, 30)]
    for ours, whole in zip(got[16], got[10_000]):
        assert_logits_close(ours, whole)


def test_a_sliced_prompt_decodes_as_transformers_does(model, monkeypatch):
    hf, _ = model
    prompt = _prompt(45, 4)
    runner = _runner(model, 16, monkeypatch)
    logits, tokens, _ = runner.generate(1, prompt, 10)
    ref_tokens, _, ref_logits = hf_greedy(hf, prompt, 10)
    assert_logits_close(logits, ref_logits)
    assert tokens == ref_tokens


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_snapshots_kept_inside_a_sliced_chunk_serve_the_next_turn(arch, monkeypatch):
    """A 33-token prompt in one 64-token step keeps its snapshot at 16, where two even slices of at most 20
    would cut; the cut moves, and the next turn starts from the snapshot and decodes as transformers does."""
    hf, spec = tiny_model(arch, seed=11)
    cuts = []
    _runner((hf, spec), 20, monkeypatch, cuts)  # the slice and the spy (its own runner unused)
    engine = Engine(hf, spec, prefill=64)
    first = _prompt(33, 1)
    ((out1, _),) = engine.run([first], 6)
    assert engine.saved_inside == 1
    assert cuts[0] in ([(0, 15), (15, 33)], [(0, 17), (17, 33)])
    second = first + out1 + _prompt(9, 2)
    ((out2, cached),) = engine.run([second], 8)
    assert cached > 0
    assert hf_greedy(hf, second, 8)[0] == out2


def test_the_estimate_prices_a_long_steps_mixers_at_one_slice():
    spec = load_model_config(QWEN3_6_35B)
    at = {t: workspace_bytes_estimate(spec, "bfloat16", t, 8, 262144) for t in (8192, 16384)}
    unsliced_growth = at[8192] - workspace_bytes_estimate(spec, "bfloat16", 4096, 8, 262144)
    # from 8k to 16k only the residual stream and the MoE grow: less than the whole layer did from 4k to 8k, twice
    assert at[16384] - at[8192] < 2 * unsliced_growth
    assert at[16384] > at[8192]
