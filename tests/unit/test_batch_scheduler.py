"""The scheduling policy driven against a model double that reads its context back from the KV pages."""

from __future__ import annotations

import numpy as np
import pytest

from ferry.services.scheduler.batcher import BatchScheduler
from ferry.shared.errors import EngineError, InvalidRequest
from ferry.shared.messages import PoolReport
from ferry.shared.sampling import SamplingParams
from tests.doubles.paged_model import PagedHashModel, reference_continuation

FIRST, COUNT = 10, 200
VOCAB = range(FIRST, FIRST + COUNT)


def make(pages=64, page_size=4, slots=0, running=8, prefill=32, model_len=128):
    pool = PoolReport(
        kv_pages=pages,
        page_size=page_size,
        linear_state_slots=slots,
        max_running_requests=running,
        max_prefill_tokens=prefill,
        max_model_len=model_len,
    )
    return BatchScheduler(pool), PagedHashModel(pages, page_size, VOCAB, slots)


def run_to_end(sched, model, max_steps=10_000):
    tokens: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            assert not (sched.running or sched.waiting), "work left but nothing schedulable"
            return tokens, finished
        out = sched.complete(model.execute(batch))
        assert not out.failed
        for req, tok in out.tokens:
            tokens.setdefault(req.rid, []).append(tok)
        for req, reason in out.finished:
            finished[req.rid] = reason
    raise AssertionError("did not finish")


def run_aborting_to_end(sched, model, aborted: set[int], after_step=lambda: None) -> dict[int, list[int]]:
    """Run every step to the end, aborting each request of `aborted` once it has two tokens, with
    `after_step` checking the scheduler's invariants after each step; the tokens each request got."""
    got: dict[int, list[int]] = {}
    while (batch := sched.schedule()) is not None:
        out = sched.complete(model.execute(batch))
        assert not out.failed
        for req, tok in out.tokens:
            got.setdefault(req.rid, []).append(tok)
        for rid in list(aborted):
            if len(got.get(rid, [])) >= 2:
                sched.abort(rid)
                aborted.discard(rid)
        after_step()
    return got


def prompt(seed, n):
    return np.random.default_rng(seed).integers(FIRST, FIRST + COUNT, n).astype(np.int32)


def add(sched, rid, p, max_tokens=None, **sampling):
    return sched.add(rid, b"api", rid, p, SamplingParams(temperature=0, **sampling), max_tokens)


def test_single_request_generates_the_reference_continuation_and_frees_its_pages():
    sched, model = make()
    p = prompt(0, 13)
    add(sched, 1, p, 9)
    tokens, finished = run_to_end(sched, model)
    assert tokens[1] == reference_continuation(p.tolist(), 9, VOCAB)
    assert finished == {1: "length"}
    assert sched.kv.available == sched.kv.total


def test_long_prompt_is_prefilled_in_chunks_mixed_with_decodes():
    sched, model = make(prefill=16)
    short, long = prompt(1, 5), prompt(2, 50)
    add(sched, 1, short, 20)
    first = sched.complete(model.execute(sched.schedule()))  # request 1 is now decoding
    add(sched, 2, long, 5)
    tokens, _ = run_to_end(sched, model)
    assert [t for _, t in first.tokens] + tokens[1] == reference_continuation(short.tolist(), 20, VOCAB)
    assert tokens[2] == reference_continuation(long.tolist(), 5, VOCAB)
    mixed = [b for b in model.batches if len(b.req_ids) == 2]
    assert mixed, "no step carried a decode and a prefill chunk together"
    assert all(int(b.query_lens.sum()) <= 16 for b in model.batches)
    assert any(q == 1 and q2 == 15 for b in mixed for q, q2 in [b.query_lens.tolist()])


def test_shared_prefix_is_reused_from_the_cache():
    sched, model = make(page_size=4)
    system = prompt(3, 20)
    a = np.concatenate([system, prompt(4, 3)])
    b = np.concatenate([system, prompt(5, 6)])
    add(sched, 1, a, 4)
    run_to_end(sched, model)
    req = add(sched, 2, b, 4)
    tokens, _ = run_to_end(sched, model)
    assert req.cached_tokens == 20
    assert tokens[2] == reference_continuation(b.tolist(), 4, VOCAB)
    assert sched.kv.available == sched.kv.total
    assert sched.kv.cache.nodes > 0


def test_cached_pages_are_evicted_when_new_requests_need_them():
    sched, model = make(pages=12, page_size=4, model_len=48)
    for rid in range(1, 6):
        p = prompt(10 + rid, 30)
        add(sched, rid, p, 10)
        tokens, _ = run_to_end(sched, model)
        assert tokens[rid] == reference_continuation(p.tolist(), 10, VOCAB)
    assert sched.kv.available == sched.kv.total


def test_preemption_lets_every_request_finish_correctly_when_pages_run_out():
    sched, model = make(pages=20, page_size=4, running=8, model_len=64)
    prompts = {rid: prompt(20 + rid, 10) for rid in range(1, 9)}
    for rid, p in prompts.items():
        add(sched, rid, p, 30)
    tokens, finished = run_to_end(sched, model)
    assert sched.preemptions > 0
    for rid, p in prompts.items():
        assert tokens[rid] == reference_continuation(p.tolist(), 30, VOCAB), rid
        assert finished[rid] == "length"
    assert sched.kv.available == sched.kv.total


def test_stop_token_finishes_with_stop():
    sched, model = make()
    p = prompt(6, 8)
    expected = reference_continuation(p.tolist(), 40, VOCAB)
    stop = expected[3]
    add(sched, 1, p, 40, stop_token_ids=(stop,))
    tokens, finished = run_to_end(sched, model)
    assert tokens[1] == expected[: expected.index(stop) + 1]
    assert finished[1] == "stop"


def test_requests_that_can_never_fit_are_rejected_at_once():
    sched, _ = make(pages=8, page_size=4, model_len=64)
    with pytest.raises(InvalidRequest, match="model length is 64"):
        add(sched, 1, prompt(0, 64), 1)
    with pytest.raises(InvalidRequest, match="exceeds the model length"):
        add(sched, 2, prompt(0, 10), 60)
    with pytest.raises(InvalidRequest, match="8 pages"):
        add(sched, 3, prompt(0, 10), 30)
    with pytest.raises(InvalidRequest, match="at least 1"):
        add(sched, 4, prompt(0, 10), -1)
    assert not (sched.running or sched.waiting)


def test_default_max_tokens_fills_the_model_length():
    sched, _ = make(pages=64, page_size=4, model_len=64)
    assert add(sched, 1, prompt(0, 10), None).max_tokens == 54


def test_abort_frees_pages_immediately_or_when_the_step_in_flight_returns():
    sched, model = make()
    add(sched, 1, prompt(7, 9), 50)
    add(sched, 2, prompt(8, 9), 50)
    sched.complete(model.execute(sched.schedule()))
    batch = sched.schedule()
    out = sched.abort(1)  # in flight: deferred
    assert not out.finished
    out = sched.complete(model.execute(batch))
    assert [(r.rid, why) for r, why in out.finished] == [(1, "abort")]
    out = sched.abort(2)  # not in flight: at once
    assert [(r.rid, why) for r, why in out.finished] == [(2, "abort")]
    assert sched.kv.available == sched.kv.total
    assert sched.schedule() is None


def test_aborted_requests_are_forgotten_by_the_worker():
    sched, model = make()
    add(sched, 1, prompt(7, 9), 50)
    add(sched, 2, prompt(8, 9), 50)
    sched.complete(model.execute(sched.schedule()))
    sched.abort(1)
    batch = sched.schedule()
    assert batch.finished_req_ids == (1,)
    assert batch.req_ids.tolist() == [2]


def test_hybrid_models_get_one_state_slot_per_running_request_and_no_prefix_reuse():
    sched, model = make(slots=2, running=8)
    system = prompt(9, 12)
    prompts = {rid: np.concatenate([system, prompt(30 + rid, 3)]) for rid in range(1, 5)}
    for rid, p in prompts.items():
        add(sched, rid, p, 6)
    tokens, _ = run_to_end(sched, model)
    assert max(len(b.req_ids) for b in model.batches) <= 2
    assert all(set(b.linear_state_slots.tolist()) <= {1, 2} for b in model.batches)
    for rid, p in prompts.items():
        assert tokens[rid] == reference_continuation(p.tolist(), 6, VOCAB)
    assert sched.kv.cache.nodes == 0


def test_worker_loss_fails_every_request_and_step_failure_only_its_batch():
    sched, model = make(running=1)
    add(sched, 1, prompt(1, 5), 5)
    add(sched, 2, prompt(2, 5), 5)
    batch = sched.schedule()
    out = sched.fail_step(batch.step_id, EngineError("boom"))
    assert [r.rid for r, _ in out.failed] == [1]
    assert sched.schedule().req_ids.tolist() == [2]
    out = sched.fail_all(EngineError("worker lost"))
    assert [r.rid for r, _ in out.failed] == [2]
    assert not (sched.running or sched.waiting) and sched.kv.available == sched.kv.total


def test_an_unusable_pool_report_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        make(prefill=0)
    with pytest.raises(ValueError, match="kv_pages"):
        make(pages=0)


def test_default_max_tokens_is_capped_by_a_pool_smaller_than_the_model_length():
    sched, model = make(pages=8, page_size=4, model_len=128)  # 32 tokens of KV, model length 128
    req = add(sched, 1, prompt(0, 10), None)
    assert req.max_tokens == 32 - 10
    tokens, finished = run_to_end(sched, model)
    assert len(tokens[1]) == 22 and finished[1] == "length"
    with pytest.raises(InvalidRequest, match="KV pool holds 32"):
        add(sched, 2, prompt(1, 40), None)


def test_a_late_answer_to_a_step_given_up_on_fails_nothing_now_in_flight():
    """After --step-timeout the scheduler fails the hung step and moves on; the worker's late
    StepDone for it must not fail the step that is in flight by then."""
    sched, model = make(running=1)
    add(sched, 1, prompt(1, 5), 5)
    hung = sched.schedule()
    sched.fail_step(hung.step_id, EngineError("step timeout"))
    add(sched, 2, prompt(2, 5), 5)
    current = sched.schedule()
    late = model.execute(hung)
    assert not sched.complete(late).failed and sched.step_in_flight
    assert not sched.fail_step(hung.step_id, EngineError("late failure")).failed and sched.step_in_flight
    out = sched.complete(model.execute(current))
    assert not out.failed and [r.rid for r, _ in out.tokens] == [2]


# ---- issue 11: prompt logprobs, max_tokens 0, prefix sharing ---------------------------------------------


class ScoringModel(PagedHashModel):
    """The double, answering prompt-logprob rows: the logprob of token p + 1 is -(p + 1), so what reaches the
    api says which positions were computed."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.prompts: dict[int, list[int]] = {}

    def execute(self, batch):
        from ferry.shared.step import Logprobs, StepOutput

        for nr in batch.new_requests:
            self.prompts[nr.req_id] = nr.prompt_token_ids.tolist()
        out = super().execute(batch)
        parts = []
        for i in np.flatnonzero(batch.prompt_logprobs if batch.prompt_logprobs is not None else []):
            rid, c, q = int(batch.req_ids[i]), int(batch.context_lens[i]), int(batch.query_lens[i])
            n = min(q, len(self.prompts[rid]) - c - 1)
            if n > 0:
                parts.append(
                    Logprobs(
                        req_id=rid,
                        start=c + 1,
                        token_logprobs=-np.arange(c + 1, c + 1 + n, dtype=np.float32),
                        top_ids=np.zeros((n, 0), np.int32),
                        top_logprobs=np.zeros((n, 0), np.float32),
                    )
                )
        return StepOutput(
            step_id=out.step_id,
            req_ids=out.req_ids,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            prompt_logprobs=tuple(parts),
        )


def run_scoring(sched, model):
    got: dict[int, list[float]] = {}
    tokens: dict[int, list[int]] = {}
    finished = {}
    while (batch := sched.schedule()) is not None:
        out = sched.complete(model.execute(batch))
        for req, lp in out.prompt_logprobs:
            assert lp.start == len(got.get(req.rid, [])) + 1, "positions arrive in order, each once"
            got.setdefault(req.rid, []).extend(lp.token_logprobs.tolist())
        for req, tok in out.tokens:
            tokens.setdefault(req.rid, []).append(tok)
        finished.update({req.rid: reason for req, reason in out.finished})
    return got, tokens, finished


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_prompt_logprobs_cover_every_position_once_even_from_a_cached_prefix(max_tokens):
    sched, _ = make(prefill=8)
    model = ScoringModel(64, 4, VOCAB)
    p = prompt(3, 21)
    add(sched, 1, p, 2)  # fills the prefix cache with p's pages
    run_scoring(sched, model)
    add(sched, 2, p, max_tokens, prompt_logprobs=1)
    got, tokens, finished = run_scoring(sched, model)
    assert got[2] == [-float(i) for i in range(1, 21)]  # positions 1..20, computed (not taken from the cache)
    assert len(tokens.get(2, [])) == max_tokens and finished[2] == "length"
    assert sched.kv.available == sched.kv.total


def test_steps_without_prompt_logprobs_mark_nothing():
    sched, model = make()
    add(sched, 1, prompt(0, 9), 3)
    batch = sched.schedule()
    assert batch.prompt_logprobs is None


def test_a_second_request_with_the_same_prompt_waits_to_reuse_its_pages():
    sched, model = make(prefill=64)
    p = prompt(5, 17)
    add(sched, 1, p, 2)
    add(sched, 2, p, 2)
    first = sched.schedule()
    assert first.req_ids.tolist() == [1]  # 2 waits while 1 prefills the same first page
    sched.complete(model.execute(first))
    second = sched.schedule()
    assert 2 in second.req_ids.tolist()
    assert sched.by_rid[2].cached_tokens == 16  # 1's full pages, from the prefix cache


def test_over_length_refusals_name_the_field_to_change():
    """The param of each refusal (Failed.param on the wire): max_tokens where lowering it would do, prompt
    where the prompt alone does not fit (the api names them as its body does: messages, max_completion_tokens)."""
    sched, _ = make(pages=8, page_size=4, model_len=64)
    for rid, (p, max_tokens, param) in enumerate(
        [
            (prompt(0, 10), 60, "max_tokens"),
            (prompt(0, 10), 30, "max_tokens"),
            (prompt(0, 64), 1, "prompt"),
            (prompt(0, 64), None, "prompt"),
            (prompt(0, 40), None, "prompt"),
            (prompt(0, 65), 0, "prompt"),
            (prompt(0, 10), -1, "max_tokens"),
        ]
    ):
        with pytest.raises(InvalidRequest) as exc:
            add(sched, rid, p, max_tokens)
        assert exc.value.param == param, (max_tokens, str(exc.value))


def test_a_request_whose_grammar_died_on_the_worker_fails_and_its_filler_token_is_dropped():
    """StepOutput.grammar_failures: the request fails (a 400 naming the grammar's fields, with the engine's
    reason), its token (the end of sequence a dead matcher falls back to) is neither sent nor a finish;
    the others in the step go on. A failure for a request that did not sample is an unusable answer."""
    from ferry.shared.step import StepOutput

    sched, model = make()
    add(sched, 1, prompt(1, 6), 5)
    add(sched, 2, prompt(2, 6), 5)
    batch = sched.schedule()
    answer = model.execute(batch)
    dead = StepOutput(
        step_id=answer.step_id,
        req_ids=answer.req_ids,
        token_ids=answer.token_ids,
        logprobs=answer.logprobs,
        grammar_failures=((1, "parser error: Too many items"),),
    )
    out = sched.complete(dead)
    assert [
        (r.rid, type(e), "output_config.format" in str(e) and "Too many items" in str(e)) for r, e in out.failed
    ] == [(1, InvalidRequest, True)]
    assert [r.rid for r, _ in out.tokens] == [2] and not out.finished
    tokens, finished = run_to_end(sched, model)
    assert 1 not in tokens and finished == {2: "length"}

    add(sched, 3, prompt(3, 6), 5)
    batch = sched.schedule()
    answer = model.execute(batch)
    stray = StepOutput(
        step_id=answer.step_id,
        req_ids=answer.req_ids,
        token_ids=answer.token_ids,
        logprobs=answer.logprobs,
        grammar_failures=((99, "x"),),
    )
    out = sched.complete(stray)
    assert [(r.rid, type(e)) for r, e in out.failed] == [(3, EngineError)] and "grammar failure" in str(
        out.failed[0][1]
    )
