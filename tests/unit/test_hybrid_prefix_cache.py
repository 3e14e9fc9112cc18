"""Hybrid models' prefix cache, the scheduler's side: linear-state snapshots at page boundaries, attached to
the radix nodes they belong to, restored into a request's slot before its first chunk and evicted with their
pages or least-recently-used. Driven against the model double, whose 'linear state' is a running hash that
must equal the hash of the tokens in the KV pages whenever a row samples: a snapshot restored at the wrong
position, or overwritten while still wanted, fails an assertion or changes the continuation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.services.scheduler.batcher import OFFLOADED_SNAPSHOT_SPAN, PROMPT_END_MARGIN, BatchScheduler, _worth_a_cut
from ferry.shared.messages import PoolReport
from ferry.shared.sampling import SamplingParams
from tests.doubles.paged_model import PagedHashModel, reference_continuation
from tests.unit.test_batch_scheduler import VOCAB, add, prompt, run_aborting_to_end, run_to_end
from tests.unit.test_schedule_ahead import run_ahead_to_end


def make(
    pages=64,
    page_size=4,
    slots=4,
    snapshots=16,
    running=4,
    prefill=32,
    model_len=128,
    prefix_cache=True,
    offloaded=False,
):
    pool = PoolReport(
        kv_pages=pages,
        page_size=page_size,
        linear_state_slots=slots,
        max_running_requests=running,
        max_prefill_tokens=prefill,
        max_model_len=model_len,
        linear_state_snapshots=snapshots,
        experts_offloaded=offloaded,
    )
    return BatchScheduler(pool, prefix_cache=prefix_cache), PagedHashModel(pages, page_size, VOCAB, slots, snapshots)


def computed(model) -> int:
    """Tokens the model computed over all steps."""
    return sum(len(b.tokens) for b in model.batches)


def one_turn(sched, model, rid, p, n):
    req = add(sched, rid, p, n)
    tokens, finished = run_to_end(sched, model)
    assert tokens[rid] == reference_continuation(p.tolist(), n, VOCAB), rid
    return req, tokens[rid]


def _finish(sched, model, first):
    """Every request's tokens: those of `first` (scheduled by the test) and of the steps after it."""
    out = sched.complete(model.execute(first))
    tokens, _ = run_to_end(sched, model)
    for req, tok in reversed(out.tokens):
        tokens.setdefault(req.rid, []).insert(0, tok)
    return tokens


@pytest.mark.parametrize("length", [22, 20], ids=["prompt-ends-mid-page", "prompt-ends-on-a-page-boundary"])
def test_a_next_turn_starts_from_the_snapshot_at_the_end_of_the_earlier_prompt(length):
    sched, model = make()
    first = prompt(1, length)
    one_turn(sched, model, 1, first, 5)
    # the next turn shares the first prompt, not its output (a template that drops reasoning, say)
    second = np.concatenate([first, prompt(2, 7)])
    req, _ = one_turn(sched, model, 2, second, 5)
    # mid-page: the last page boundary PROMPT_END_MARGIN (8) tokens before its end; on a boundary, its end itself
    assert PROMPT_END_MARGIN == 8 and req.cached_tokens == (12 if length == 22 else 20)
    assert model.restored_tokens == req.cached_tokens
    assert sched.prefix_hits == 1 and sched.kv.available == sched.kv.total


def test_the_prompt_end_snapshot_is_kept_inside_its_chunk_in_one_step():
    """The last page boundary PROMPT_END_MARGIN tokens before the prompt's end (12 of 22) is saved by the
    forward itself (StepBatch.save_offset): the prompt is one step, not a cut and a tail."""
    sched, model = make(prefill=64)
    add(sched, 1, prompt(3, 22), 3)
    first = sched.schedule()
    assert first.query_lens.tolist() == [22] and first.sample.tolist() == [True]
    assert first.save_state is not None and first.save_state[0] >= 0 and first.save_offset.tolist() == [12]
    sched.complete(model.execute(first))
    assert model.saved_inside == 1 and sched.snapshots.held == 1


def test_a_prompt_ending_on_a_page_boundary_is_still_cut_for_its_snapshot_before_the_margin():
    """A row keeps one state a step: a prompt whose end is itself a page boundary (it saves there) is cut
    at its prompt-end point as before, and its tail computed next."""
    sched, model = make(prefill=64)
    add(sched, 1, prompt(3, 24), 3)
    first = sched.schedule()
    assert first.query_lens.tolist() == [16] and first.sample.tolist() == [False] and first.save_offset is None
    sched.complete(model.execute(first))
    second = sched.schedule()
    assert second.query_lens.tolist() == [8] and second.sample.tolist() == [True]


def test_a_conversation_resumes_from_the_last_page_boundary_of_its_output():
    sched, model = make()
    first = prompt(4, 13)
    _, out = one_turn(sched, model, 1, first, 9)
    # the template reproduces the output: the next turn extends prompt + output
    second = np.concatenate([first, np.array(out, np.int32), prompt(5, 6)])
    req, _ = one_turn(sched, model, 2, second, 4)
    # 13 + 9 tokens, the last not computed: the output's last snapshot is at 20
    assert req.cached_tokens == 20
    third = np.concatenate([second, prompt(6, 3)])
    req3, _ = one_turn(sched, model, 3, third, 4)
    assert req3.cached_tokens >= (len(second) - 1) // 4 * 4


def test_only_the_last_snapshot_of_an_output_is_kept():
    sched, model = make(snapshots=32)
    one_turn(sched, model, 1, prompt(7, 13), 40)
    # the prompt's end (4) and the output's last boundary (52): the output's others were replaced in turn
    assert sched.snapshots.held == 2


def test_n_choices_compute_the_prompt_once():
    sched, model = make(prefill=64)
    p = prompt(8, 30)
    for rid in (1, 2, 3):
        add(sched, rid, p, 4)
    first = sched.schedule()
    assert first.req_ids.tolist() == [1]  # the others wait for its snapshot
    assert first.query_lens.tolist() == [30] and first.save_offset.tolist() == [20]  # kept inside the step
    tokens = _finish(sched, model, first)
    expected = reference_continuation(p.tolist(), 4, VOCAB)
    assert all(tokens[rid] == expected for rid in (1, 2, 3))
    assert [sched.by_rid.get(rid) for rid in (1, 2, 3)] == [None] * 3
    # 30 prompt tokens once, then the others' tails (from the prompt-end snapshot at 20), plus the decodes
    assert computed(model) == 30 + 2 * 10 + 3 * 3
    assert model.restored_tokens == 2 * 20


def test_requests_sharing_a_system_prompt_wait_for_its_snapshot_and_compute_only_their_own_part():
    sched, model = make(prefill=256, running=8, slots=8, model_len=256, pages=128)
    system = prompt(9, 50)
    prompts = {rid: np.concatenate([system, prompt(100 + rid, 9)]) for rid in range(1, 9)}
    for rid, p in prompts.items():
        add(sched, rid, p, 3)
    first = sched.schedule()
    # where the prompts part (48, also its prompt-end point) is kept inside request 1's one step
    assert first.req_ids.tolist() == [1] and first.query_lens.tolist() == [59] and first.save_offset.tolist() == [48]
    tokens = _finish(sched, model, first)
    for rid, p in prompts.items():
        assert tokens[rid] == reference_continuation(p.tolist(), 3, VOCAB)
    assert model.restored_tokens == 7 * 48
    assert computed(model) == 59 + 7 * 11 + 8 * 2


def test_requests_arriving_while_the_first_computes_their_shared_prompt_wait_for_the_second_to_keep_it():
    sched, model = make(prefill=256, running=8, slots=8, model_len=256, pages=128)
    system = prompt(9, 50)
    add(sched, 1, np.concatenate([system, prompt(200, 20)]), 3)
    first = sched.schedule()  # request 1 alone: the others arrive while its step runs, past where they part
    assert first.query_lens.tolist() == [70] and first.save_offset.tolist() == [60]  # its prompt-end snapshot
    later = [add(sched, rid, np.concatenate([system, prompt(200 + rid, 20)]), 3) for rid in range(2, 9)]
    sched.complete(model.execute(first))
    second = sched.schedule()
    # request 2 computes the shared part again, keeping its state where the prompts part (a cut: its
    # prompt-end point follows in the same chunk); 3..8 wait for it
    assert second.req_ids.tolist() == [1, 2] and second.query_lens.tolist() == [1, 48]
    sched.complete(model.execute(second))
    run_to_end(sched, model)
    assert [r.cached_tokens for r in later] == [0] + [48] * 6
    # a later round finds the snapshot at once: every request computes only its own part
    reqs = [add(sched, rid, np.concatenate([system, prompt(300 + rid, 20)]), 3) for rid in range(11, 19)]
    tokens, _ = run_to_end(sched, model)
    assert [r.cached_tokens for r in reqs] == [48] * 8
    for r in reqs:
        assert tokens[r.rid] == reference_continuation(r.tokens[: r.prompt_len], 3, VOCAB)


def test_a_shared_prefix_seen_before_gets_its_snapshot_the_second_time():
    sched, model = make()
    system = prompt(10, 18)
    one_turn(sched, model, 1, np.concatenate([system, prompt(11, 20)]), 3)
    req2, _ = one_turn(sched, model, 2, np.concatenate([system, prompt(12, 20)]), 3)
    assert req2.cached_tokens == 0  # no state was kept where the two part
    req3, _ = one_turn(sched, model, 3, np.concatenate([system, prompt(13, 20)]), 3)
    assert req3.cached_tokens == 16  # the second one kept it, at the last page boundary they share


def test_a_long_prefill_keeps_a_snapshot_at_every_chunk_and_a_shorter_match_uses_the_deepest_before_it():
    sched, model = make(prefill=10)
    p = prompt(14, 40)
    one_turn(sched, model, 1, p, 2)
    # chunks the budget cuts short end on page boundaries: 8, 16, 24, 32, then the prompt's end (40)
    assert sched.snapshots.held >= 5
    req, _ = one_turn(sched, model, 2, np.concatenate([p[:27], prompt(15, 6)]), 3)
    assert req.cached_tokens == 24


def test_after_the_deeper_snapshot_is_evicted_with_its_pages_a_request_starts_from_a_shallower_one():
    sched, model = make(pages=14, prefill=8, model_len=56)
    p = prompt(16, 33)
    one_turn(sched, model, 1, p, 2)
    assert sched.snapshots.held == 4  # at 8, 16, 24 (chunk ends) and 32 (the prompt's last page boundary)
    # another request needs pages: the least recently used leaves go, the deepest of p's with them
    one_turn(sched, model, 2, prompt(17, 30), 10)
    assert sched.snapshots.evictions > 0
    req, _ = one_turn(sched, model, 3, np.concatenate([p, prompt(18, 4)]), 3)
    assert 0 < req.cached_tokens < 32
    assert model.restored_tokens >= req.cached_tokens


def test_a_full_snapshot_pool_drops_its_least_recently_used_snapshot():
    sched, model = make(snapshots=2, prefill=8)
    a, b = prompt(19, 18), prompt(20, 18)
    one_turn(sched, model, 1, a, 1)
    one_turn(sched, model, 2, b, 1)
    assert sched.snapshots.held == 2 and sched.snapshots.evictions > 0
    # a's snapshots are gone (b's took their ids): a again computes from the start; b's last one is there
    assert one_turn(sched, model, 3, np.concatenate([b, prompt(22, 3)]), 2)[0].cached_tokens == 16
    assert one_turn(sched, model, 4, np.concatenate([a, prompt(21, 3)]), 2)[0].cached_tokens == 0


def test_a_preempted_request_resumes_from_its_snapshot():
    sched, model = make(pages=20, page_size=4, slots=8, running=8, model_len=64, snapshots=32)
    prompts = {rid: prompt(30 + rid, 10) for rid in range(1, 9)}
    for rid, p in prompts.items():
        add(sched, rid, p, 30)
    tokens, finished = run_to_end(sched, model)
    assert sched.preemptions > 0
    for rid, p in prompts.items():
        assert tokens[rid] == reference_continuation(p.tolist(), 30, VOCAB), rid
    assert model.restored_tokens > 0  # the preempted ones restarted from a snapshot, not from scratch
    assert sched.kv.available == sched.kv.total


def test_steps_scheduled_ahead_keep_snapshots_right():
    sched, model = make()
    first = prompt(23, 9)
    add(sched, 1, first, 20)
    tokens, _, ahead, _ = run_ahead_to_end(sched, model)
    assert ahead > 0 and tokens[1] == reference_continuation(first.tolist(), 20, VOCAB)
    second = np.concatenate([first, np.array(tokens[1], np.int32), prompt(24, 3)])
    req = add(sched, 2, second, 5)
    tokens, _, _, _ = run_ahead_to_end(sched, model)
    assert tokens[2] == reference_continuation(second.tolist(), 5, VOCAB)
    assert req.cached_tokens == 28  # 9 + 20, the last token not computed: its output's last boundary


@pytest.mark.parametrize("snapshots,prefix_cache", [(0, True), (16, False)], ids=["no-snapshots", "no-prefix-cache"])
def test_without_snapshots_or_with_the_prefix_cache_off_nothing_is_reused(snapshots, prefix_cache):
    sched, model = make(snapshots=snapshots, prefix_cache=prefix_cache)
    first = prompt(25, 22)
    one_turn(sched, model, 1, first, 3)
    req, _ = one_turn(sched, model, 2, np.concatenate([first, prompt(26, 5)]), 3)
    assert req.cached_tokens == 0 and model.restored_tokens == 0
    assert all(b.restore_state is None and b.save_state is None for b in model.batches)
    assert sched.kv.cache.nodes == 0


def test_no_prefix_cache_turns_reuse_off_for_attention_only_models_too():
    pool = PoolReport(
        kv_pages=64, page_size=4, linear_state_slots=0, max_running_requests=4, max_prefill_tokens=32, max_model_len=128
    )
    sched, model = BatchScheduler(pool, prefix_cache=False), PagedHashModel(64, 4, VOCAB)
    first = prompt(27, 22)
    one_turn(sched, model, 1, first, 3)
    assert one_turn(sched, model, 2, np.concatenate([first, prompt(28, 5)]), 3)[0].cached_tokens == 0


workload = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 14), st.integers(1, 12), st.booleans(), st.booleans()),
    min_size=1,
    max_size=10,
)  # (shared prefix id, own prompt length, max_tokens, abort midway, extend an earlier conversation)


@settings(max_examples=60, deadline=None)
@given(workload, st.integers(10, 40), st.sampled_from([2, 4]), st.integers(4, 48), st.integers(1, 6), st.booleans())
def test_random_hybrid_workloads_generate_the_reference_and_return_every_page_and_snapshot(
    jobs, pages, page_size, prefill, snapshots, ahead
):
    vocab = range(10, 60)
    pool = PoolReport(
        kv_pages=pages,
        page_size=page_size,
        linear_state_slots=3,
        max_running_requests=3,
        max_prefill_tokens=prefill,
        max_model_len=64,
        linear_state_snapshots=snapshots,
    )
    sched, model = BatchScheduler(pool), PagedHashModel(pages, page_size, vocab, 3, snapshots)
    prefixes = [np.random.default_rng(p).integers(10, 60, 9).tolist() for p in range(4)]
    expected, aborted, sequences = {}, set(), []
    for rid, (prefix, own, max_tokens, abort, extend) in enumerate(jobs, start=1):
        base = sequences[-1] if extend and sequences else prefixes[prefix]
        p = base + np.random.default_rng(100 + rid).integers(10, 60, own).tolist()
        try:
            sched.add(rid, b"c", rid, np.array(p, np.int32), SamplingParams(temperature=0), max_tokens)
        except Exception:  # noqa: BLE001 - too big for this pool: refused at admission, fine
            continue
        expected[rid] = reference_continuation(p, max_tokens, vocab)
        sequences.append(p + expected[rid])
        if abort:
            aborted.add(rid)
    if ahead:
        tokens, _, _, _ = run_ahead_to_end(sched, model)
        for rid, t in tokens.items():
            assert t == expected[rid]
    else:

        def snapshots_add_up() -> None:
            attached = [n for n in _nodes(sched.kv.cache.root) if n.snapshot is not None]
            assert len(attached) == sched.snapshots.held <= snapshots
            assert len({n.snapshot.id for n in attached}) == len(attached)

        got = run_aborting_to_end(sched, model, aborted, snapshots_add_up)
        for rid, tokens in got.items():
            assert tokens == expected[rid][: len(tokens)]
    assert not (sched.running or sched.waiting)
    assert sched.kv.available == pages and sched.linear_state.free_count == 3
    assert sched.snapshots.free_count + sched.snapshots.held == snapshots  # none leaked as pending


def _nodes(root):
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


# ---- experts offloaded: a cut for a snapshot costs a pass over the missed experts ----------------------


def test_points_closer_than_the_span_give_way_to_the_deeper_one():
    assert _worth_a_cut({10, 20, 300}, 0, 256) == {300}
    assert _worth_a_cut({300, 520}, 0, 256) == {520}
    assert _worth_a_cut({300, 600}, 0, 256) == {300, 600}
    assert _worth_a_cut({300, 600}, 100, 256) == {600}
    assert _worth_a_cut({10, 20}, 0, 256) == {20}  # the deepest alone costs no cut: it is saved inside its step
    assert _worth_a_cut({4, 8, 12}, 0, 1) == {4, 8, 12}  # every expert resident: every point


def test_a_point_other_requests_want_comes_before_a_deeper_prompt_end_within_the_span():
    assert _worth_a_cut({3952, 4096}, 0, 256, wanted={3952}) == {3952}
    assert _worth_a_cut({3952, 4096}, 0, 256) == {4096}  # nobody waits for 3952: the prompt end, the deepest
    assert _worth_a_cut({300, 4096}, 0, 256, wanted={300}) == {300, 4096}  # far apart: both


@pytest.mark.parametrize("together", [True, False], ids=["arriving-together", "arriving-after-the-first-step"])
def test_offloaded_streams_sharing_a_cold_system_prompt_wait_for_its_snapshot_and_sample_the_step_after(together):
    """The cold round of issue 23's 8 streams (measured on the H200: 10.4 s against 0.62 s without the cache):
    the first request's prompt end lay within the span past the system prompt it shares with the others,
    and was kept in its place, so the others found no snapshot where they part, computed the system
    prompt's second chunk again and again, each waiting for the one before. Now the shared point is kept,
    the others wait for it, and all seven sample in the step after it."""
    system = prompt(21, 900)
    prompts = {rid: np.concatenate([system, prompt(200 + rid, 20 + rid)]) for rid in range(8)}
    sched, model = make(pages=2048, prefill=512, running=8, slots=8, snapshots=32, model_len=1024, offloaded=True)
    add(sched, 0, prompts[0], 3)
    if together:
        for rid in range(1, 8):
            add(sched, rid, prompts[rid], 3)
    first_token, steps, tokens = {}, [], {}
    while len(first_token) < 8:
        batch = sched.schedule()
        steps.append(batch.query_lens.tolist())
        if not together and len(steps) == 1:
            for rid in range(1, 8):
                add(sched, rid, prompts[rid], 3)
        for req, tok in sched.complete(model.execute(batch)).tokens:
            first_token.setdefault(req.rid, len(steps))
            tokens.setdefault(req.rid, []).append(tok)
    # the first prompt in two chunks, the second keeping the state where they part (900, inside it: its end,
    # 920, is a page boundary whose own snapshot gives way), then the others' own parts from there
    assert steps[:2] == [[512], [408]] and sorted(steps[2]) == [1] + [20 + rid for rid in range(1, 8)]  # 1: its decode
    assert first_token == {0: 2, **{rid: 3 for rid in range(1, 8)}}
    rest, _ = run_to_end(sched, model)
    for rid, p in prompts.items():
        assert tokens[rid] + rest.get(rid, []) == reference_continuation(p.tolist(), 3, VOCAB)


@pytest.mark.parametrize("length", [24, 2000], ids=["short", "the-2000-token-bench-prompt"])
def test_offloaded_a_prompt_ending_on_a_page_is_one_step_keeping_its_prompt_end_inside(length):
    """With every expert resident such a prompt is cut at its prompt-end point and its end keeps a snapshot
    too (the test above); with experts offloaded that cut would cost a pass over the missed experts, so
    the prompt is one step, its prompt-end point kept inside it and its end keeping none."""
    sched, model = make(pages=1024, prefill=2048, model_len=4096, offloaded=True)
    add(sched, 1, prompt(3, length), 3)
    first = sched.schedule()
    assert first.query_lens.tolist() == [length] and first.sample.tolist() == [True]
    assert first.save_offset.tolist() == [(length - PROMPT_END_MARGIN) // 4 * 4]
    tokens = _finish(sched, model, first)
    assert tokens[1] == reference_continuation(prompt(3, length).tolist(), 3, VOCAB)
    assert model.saved_inside == 1


def test_offloaded_a_long_prompt_keeps_its_prompt_end_snapshot_for_the_next_turn():
    long = OFFLOADED_SNAPSHOT_SPAN + 46
    sched, model = make(pages=512, prefill=1024, model_len=1024, offloaded=True)
    first = prompt(11, long)
    one_turn(sched, model, 1, first, 3)
    req, _ = one_turn(sched, model, 2, np.concatenate([first, prompt(12, 7)]), 3)
    assert req.cached_tokens == (long - PROMPT_END_MARGIN) // 4 * 4


def test_offloaded_requests_sharing_a_cached_system_prompt_take_one_step_each():
    """The warm round of issue 23's 8 streams: the system prompt's snapshot is cached, and each request's own
    part (a shared header, then its question: shorter than the span) is computed in the same step as the
    others' and samples there. With every expert resident the same requests are cut where they part and
    at their prompts' ends (three steps), since there a cut costs only a round trip."""
    for offloaded in (True, False):
        sched, model = make(pages=1024, prefill=2048, running=8, slots=8, model_len=1024, offloaded=offloaded)
        system = prompt(13, 300)
        one_turn(sched, model, 1, np.concatenate([system, prompt(14, 9)]), 2)
        one_turn(sched, model, 2, np.concatenate([system, prompt(15, 9)]), 2)  # kept where the two part: 300
        header = prompt(16, 8)
        prompts = {rid: np.concatenate([system, header, prompt(100 + rid, 40)]) for rid in range(3, 11)}
        for rid, p in prompts.items():
            add(sched, rid, p, 3)
        first = sched.schedule()
        if offloaded:
            assert sorted(first.req_ids.tolist()) == list(range(3, 11)) and first.sample.all()
            assert first.query_lens.tolist() == [48] * 8  # from the snapshot at 300
        else:
            assert first.req_ids.tolist() == [3] and first.query_lens.tolist() == [8] and not first.sample.any()
        tokens = _finish(sched, model, first)
        for rid, p in prompts.items():
            assert tokens[rid] == reference_continuation(p.tolist(), 3, VOCAB)
