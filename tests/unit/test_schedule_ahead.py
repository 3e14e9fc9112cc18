"""Scheduling ahead (BatchScheduler.schedule_ahead): a decode step sent before the previous step's answer,
its rows fed the tokens the worker sampled there, against the model double that reads its context back
from the KV pages, so a page released or reused while a step ahead still writes it changes the output."""

from __future__ import annotations

from collections import deque

import pytest

from ferry.shared.errors import EngineError
from ferry.shared.sampling import SamplingParams
from tests.doubles.fake_worker import DelayedExecutor
from tests.doubles.paged_model import reference_continuation
from tests.unit.test_batch_scheduler import VOCAB, add, make, prompt


def run_ahead_to_end(
    sched,
    model,
    abort_at: dict[int, int] | None = None,
    max_answers=10_000,
    in_flight_at_abort: dict[int, int] | None = None,
):
    """Drive the scheduler as its service does: send a step when none is in flight, then the step ahead;
    the worker runs what it was sent in order (feeding fed rows from the step before); one answer lands at a
    time. `abort_at`: {rid: after how many answers to abort it}, the abort arriving before the next answer
    lands (`in_flight_at_abort` records how many steps were in flight then). Returns tokens, finish
    reasons, and how many steps were sent ahead and the most in flight at once."""
    tokens: dict[int, list[int]] = {}
    finished: dict[int, str] = {}
    worker = DelayedExecutor(model, 0)
    sent, answers = deque(), deque()
    unanswered: deque[set[int]] = deque()  # the rows of each step sent and not answered yet

    def send(batch) -> None:
        # the worker forgets a request's sampler state when told: never while a step it is in still runs
        held = set().union(*unanswered) if unanswered else set()
        assert held.isdisjoint(batch.finished_req_ids), "a request forgotten while a step in flight holds it"
        unanswered.append(set(batch.req_ids.tolist()))
        sent.append(batch)

    ahead = most = landed = 0
    for _ in range(max_answers):
        if not sched.step_in_flight and (batch := sched.schedule()) is not None:
            send(batch)
        while (batch := sched.schedule_ahead()) is not None:  # as many as the scheduler allows
            assert batch.feed_sampled is not None and batch.feed_sampled.all()
            send(batch)
            ahead += 1
        most = max(most, sched.steps_in_flight)
        while sent:  # the worker launches each step as it arrives
            answers.append(worker.execute(sent.popleft()))
        if not answers:
            assert not (sched.running or sched.waiting), "work left but nothing schedulable"
            return tokens, finished, ahead, most
        for rid, when in (abort_at or {}).items():
            if when == landed:
                if in_flight_at_abort is not None:
                    in_flight_at_abort[rid] = sched.steps_in_flight
                for req, reason in sched.abort(rid).finished:
                    assert req.rid not in finished, f"request {req.rid} finished twice"
                    finished[req.rid] = reason
        result = sched.complete(answers.popleft())
        unanswered.popleft()
        landed += 1
        assert not result.failed
        for req, tok in result.tokens:
            tokens.setdefault(req.rid, []).append(tok)
        for req, reason in result.finished:
            assert req.rid not in finished, f"request {req.rid} finished twice"
            finished[req.rid] = reason
    raise AssertionError("did not finish")


def make_one_ahead(**pool):
    """A scheduler with --schedule-ahead-steps 1 (the default is 2): at most two steps in flight."""
    sched, model = make(**pool)
    sched.schedule_ahead_steps = 1
    return sched, model


def test_one_step_ahead_gives_the_reference_continuations_and_returns_every_page():
    sched, model = make_one_ahead(pages=64, page_size=4)
    prompts = {rid: prompt(rid, 5 + 3 * rid) for rid in range(1, 5)}
    lengths = {1: 1, 2: 7, 3: 12, 4: 20}
    for rid, p in prompts.items():
        add(sched, rid, p, lengths[rid])
    tokens, finished, ahead, most = run_ahead_to_end(sched, model)
    for rid, p in prompts.items():
        assert tokens[rid] == reference_continuation(p.tolist(), lengths[rid], VOCAB), rid
    assert finished == {rid: "length" for rid in prompts}
    assert ahead > 10 and most == 2
    assert sched.kv.available == sched.kv.total and not sched.steps_in_flight


@pytest.mark.parametrize("steps", [2, 3])
def test_several_steps_ahead_give_the_reference_continuations_and_return_every_page(steps):
    """--schedule-ahead-steps N: up to N decode steps out beyond the oldest unanswered one, each fed by the one
    before it; requests of every length, one stopping on a token and one aborted while steps are in flight,
    end with the reference tokens, each once, and every page back."""
    sched, model = make(pages=64, page_size=4)
    sched.schedule_ahead_steps = steps
    prompts = {rid: prompt(rid, 5 + 3 * rid) for rid in range(1, 6)}
    lengths = {1: 1, 2: 7, 3: 12, 4: 20, 5: 30}
    stop = reference_continuation(prompts[3].tolist(), 12, VOCAB)[5]  # request 3 stops on its 6th token
    for rid, p in prompts.items():
        add(sched, rid, p, lengths[rid], **({"stop_token_ids": (stop,)} if rid == 3 else {}))
    when: dict[int, int] = {}
    tokens, finished, ahead, most = run_ahead_to_end(sched, model, abort_at={5: 9}, in_flight_at_abort=when)
    for rid, p in prompts.items():
        want = reference_continuation(p.tolist(), lengths[rid], VOCAB, stop_ids=(stop,) if rid == 3 else ())
        assert tokens.get(rid, []) == want[: len(tokens.get(rid, []))], rid
        if rid != 5:
            assert tokens[rid] == want, rid
    assert finished == {1: "length", 2: "length", 3: "stop", 4: "length", 5: "abort"}
    assert most == 1 + steps and when[5] == 1 + steps  # the abort came with every step allowed in flight
    assert ahead > 10 and sched.kv.available == sched.kv.total and not sched.steps_in_flight


def test_the_steps_ahead_read_the_positions_the_steps_before_them_produce():
    sched, model = make()
    sched.schedule_ahead_steps = 3
    add(sched, 1, prompt(1, 8), 10)
    first = sched.schedule()
    ahead = [sched.schedule_ahead() for _ in range(4)]
    assert first.feed_sampled is None and ahead[3] is None  # three ahead at most
    assert [a.context_lens.tolist() for a in ahead[:3]] == [[8], [9], [10]]
    assert sched.steps_in_flight == 4


def test_a_request_that_stops_while_its_next_step_is_in_flight_drops_that_token_and_keeps_its_pages_till_then():
    sched, model = make(pages=16, page_size=4)
    p = prompt(7, 6)
    reference = reference_continuation(p.tolist(), 30, VOCAB)
    stop = reference[9]  # its 10th token stops it, with the step after it already sent
    expect = reference_continuation(p.tolist(), 30, VOCAB, stop_ids=(stop,))
    add(sched, 1, p, 30, stop_token_ids=(stop,))
    other = prompt(8, 9)
    add(sched, 2, other, 25)  # decodes on, in pages the stopped request's might be handed to too early
    tokens, finished, ahead, _ = run_ahead_to_end(sched, model)
    assert tokens[1] == expect and finished[1] == "stop"
    assert tokens[2] == reference_continuation(other.tolist(), 25, VOCAB) and finished[2] == "length"
    assert ahead > 0 and sched.kv.available == sched.kv.total


def test_an_abort_with_two_steps_in_flight_finishes_the_request_once_and_frees_it_after_both():
    sched, model = make_one_ahead()
    add(sched, 1, prompt(1, 8), 40)
    add(sched, 2, prompt(2, 8), 12)
    when: dict[int, int] = {}
    tokens, finished, _, _ = run_ahead_to_end(sched, model, abort_at={1: 5}, in_flight_at_abort=when)
    assert when == {1: 2}, "the abort must come with a step and the one scheduled ahead of it in flight"
    assert finished == {1: "abort", 2: "length"}
    assert (
        len(tokens[1]) < 40 and tokens[1] == reference_continuation(prompt(1, 8).tolist(), 40, VOCAB)[: len(tokens[1])]
    )
    assert sched.kv.available == sched.kv.total


def test_no_step_goes_ahead_for_sampling_that_reads_its_own_output_nor_past_the_last_token_nor_with_room_for_a_queue():
    sched, model = make_one_ahead()
    add(sched, 1, prompt(1, 8), 10, repetition_penalty=1.2)
    assert sched.schedule() is not None and sched.schedule_ahead() is None  # penalties read the output on the worker
    sched, model = make_one_ahead()
    add(sched, 1, prompt(1, 8), 1)
    assert sched.schedule() is not None and sched.schedule_ahead() is None  # the token in flight is its last
    sched, model = make_one_ahead(running=2)
    add(sched, 1, prompt(1, 8), 10)
    assert sched.schedule() is not None
    add(sched, 2, prompt(2, 8), 10)
    assert sched.schedule_ahead() is None  # a request waits and the batch has room for it: the pipeline drains
    sched, model = make_one_ahead()
    add(sched, 1, prompt(1, 8), 10)
    batch = sched.schedule()
    ahead = sched.schedule_ahead()
    assert ahead is not None and sched.schedule_ahead() is None  # two in flight at most
    assert ahead.context_lens.tolist() == [8] and not ahead.reset_linear_state.any() and ahead.tokens.tolist() == [0]
    assert batch.feed_sampled is None


def test_a_full_batch_keeps_going_ahead_while_requests_wait_and_admits_them_as_running_ones_end():
    # one request may run: the others wait whatever the pipeline does, so it does not drain for them
    sched, model = make_one_ahead(running=1)
    add(sched, 1, prompt(1, 8), 10)
    add(sched, 2, prompt(2, 8), 10)
    assert sched.schedule() is not None and sched.schedule_ahead() is not None
    sched, model = make_one_ahead(running=2)
    prompts = {rid: prompt(rid, 6 + rid) for rid in range(1, 6)}
    lengths = {1: 9, 2: 14, 3: 6, 4: 11, 5: 8}
    stop = reference_continuation(prompts[2].tolist(), 14, VOCAB)[4]  # request 2 stops early, on a token
    for rid, p in prompts.items():
        add(sched, rid, p, lengths[rid], **({"stop_token_ids": (stop,)} if rid == 2 else {}))
    tokens, finished, ahead, most = run_ahead_to_end(sched, model)
    for rid, p in prompts.items():
        expect = reference_continuation(p.tolist(), lengths[rid], VOCAB, stop_ids=(stop,) if rid == 2 else ())
        assert tokens[rid] == expect, rid
    assert finished == {1: "length", 2: "stop", 3: "length", 4: "length", 5: "length"}
    # queued requests no longer drain the pipeline at every step: 16 steps went ahead here, 7 when they did
    assert ahead > 12 and most == 2 and sched.kv.available == sched.kv.total


def test_failing_every_step_in_flight_fails_each_request_once_and_frees_it():
    sched, _ = make()
    add(sched, 1, prompt(1, 8), 10)
    add(sched, 2, prompt(2, 8), 10)
    sched.schedule()
    assert sched.schedule_ahead() is not None and sched.steps_in_flight == 2
    out = sched.fail_in_flight(EngineError("gone"))
    assert sorted(req.rid for req, _ in out.failed) == [1, 2] and not out.finished
    assert not sched.step_in_flight and not sched.running and sched.kv.available == sched.kv.total


def test_sampling_params_say_which_requests_read_their_own_output():
    assert not SamplingParams().reads_its_output and not SamplingParams(seed=3, logit_bias=((5, 1.0),)).reads_its_output
    for reads in (
        {"repetition_penalty": 1.1},
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.5},
        {"grammar": "{}"},
    ):
        assert SamplingParams(**reads).reads_its_output


def test_hybrid_rows_ahead_keep_their_linear_state_slot():
    sched, model = make(slots=2)
    prompts = {1: prompt(3, 7), 2: prompt(4, 11)}
    for rid, p in prompts.items():
        add(sched, rid, p, 15)
    tokens, finished, ahead, _ = run_ahead_to_end(sched, model)
    for rid, p in prompts.items():
        assert tokens[rid] == reference_continuation(p.tolist(), 15, VOCAB)
    assert ahead > 0 and sched.linear_state.free_count == 2  # both slots back once both requests ended
    assert finished == {1: "length", 2: "length"}


def test_the_service_does_not_call_a_step_lost_when_the_worker_already_holds_the_step_after_it(tmp_path):
    """The worker's heartbeat names the last step it received: with a step scheduled ahead that is newer
    than the oldest in flight, which the worker has therefore received too (it may say idle for a moment
    between answering one step and starting the next)."""
    import time

    import zmq

    from ferry.services.scheduler.config import SchedulerConfig
    from ferry.services.scheduler.service import SchedulerService
    from ferry.shared.messages import PoolReport, WorkerAlive

    ctx = zmq.Context()
    svc = SchedulerService(
        SchedulerConfig(f"ipc://{tmp_path}/a", f"ipc://{tmp_path}/s", f"ipc://{tmp_path}/r", "127.0.0.1", None, 60.0),
        ctx,
    )
    try:
        pool = PoolReport(
            kv_pages=64,
            page_size=4,
            linear_state_slots=0,
            max_running_requests=8,
            max_prefill_tokens=32,
            max_model_len=128,
            vocab_size=1000,
        )
        svc._worker_alive(WorkerAlive(boot_id="w", pool=pool))
        add(svc.core, 1, prompt(1, 8), 10)
        first, ahead = svc.core.schedule(), svc.core.schedule_ahead()
        now = time.monotonic()
        svc._step_sent_at = now - 10
        for last_step, lost in ((ahead.step_id, False), (first.step_id, False), (first.step_id - 1, True)):
            svc._worker_said = (now, last_step, 0.0)
            svc._check_step_in_flight()
            assert svc.core.step_in_flight is not lost, last_step
    finally:
        svc.close()
        ctx.term()
