"""Prompts arriving together share one prefill step when experts are offloaded (batcher.arrival_hold_s,
--prefill-coalesce-ms): each prefill step pays a pass over the experts without a GPU slot, so an idle
scheduler holds new prompts while more keep coming, and never holds a step a running request waits for."""

from __future__ import annotations

import numpy as np
import pytest

from ferry.services.scheduler.batcher import ARRIVAL_GAP_FRACTION, DEFAULT_PREFILL_COALESCE_MS, BatchScheduler
from ferry.services.scheduler.config import prefill_coalesce_s
from ferry.shared.errors import ConfigError, ServiceUnavailable
from ferry.shared.messages import PoolReport
from ferry.shared.sampling import SamplingParams

ARRIVAL_GAP_S = DEFAULT_PREFILL_COALESCE_MS / 1000 * ARRIVAL_GAP_FRACTION  # 20 ms


def make(offloaded=True, coalesce_s=DEFAULT_PREFILL_COALESCE_MS / 1000):
    pool = PoolReport(
        kv_pages=64,
        page_size=4,
        linear_state_slots=0,
        max_running_requests=8,
        max_prefill_tokens=64,
        max_model_len=128,
        experts_offloaded=offloaded,
    )
    return BatchScheduler(pool, prefill_coalesce_s=coalesce_s)


def add(sched, rid, now):
    p = np.random.default_rng(rid).integers(10, 200, 6).astype(np.int32)
    return sched.add(rid, b"api", rid, p, SamplingParams(temperature=0), 4, now=now)


def test_a_burst_is_held_while_it_keeps_arriving_and_goes_as_one_step():
    sched = make()
    add(sched, 1, now=10.0)
    assert sched.arrival_hold_s(10.001) == pytest.approx(ARRIVAL_GAP_S - 0.001)
    add(sched, 2, now=10.013)
    add(sched, 3, now=10.015)
    assert sched.arrival_hold_s(10.016) == pytest.approx(10.015 + ARRIVAL_GAP_S - 10.016)
    assert sched.arrival_hold_s(10.015 + ARRIVAL_GAP_S) == 0.0  # the gap passed: they go
    batch = sched.schedule()
    assert sorted(set(batch.req_ids)) == [1, 2, 3]


def test_the_hold_ends_at_the_window_however_long_the_arrivals_go_on():
    sched = make(coalesce_s=0.012)  # a gap of 4 ms
    for rid, ms in enumerate((0, 3, 6), start=1):  # 3 ms apart, within the gap: each one extends the hold
        add(sched, rid, now=20 + ms / 1000)
        assert sched.arrival_hold_s(20 + (ms + 1) / 1000) == pytest.approx(0.003)
    add(sched, 4, now=20.011)
    assert sched.arrival_hold_s(20.0115) == pytest.approx(0.0005)  # cut at 12 ms after the first, not 15
    assert sched.arrival_hold_s(20.012) == 0.0
    assert sorted(set(sched.schedule().req_ids)) == [1, 2, 3, 4]


def test_eight_clients_spread_as_measured_share_one_step():
    """The warm round of issue 23's 8 streams on the H200 (6ca8627): the api saw the prompts over 49.6 ms,
    these gaps apart. The old 4 ms gap sent the first alone; the default window takes all eight."""
    sched = make()
    now = 30.0
    for rid, gap_ms in enumerate((0, 12.6, 2.0, 11.4, 3.6, 0.5, 18.6, 0.9), start=1):
        now += gap_ms / 1000
        assert rid == 1 or sched.arrival_hold_s(now) > 0  # the ones before are still held when it comes
        add(sched, rid, now=now)
    assert sched.arrival_hold_s(now + ARRIVAL_GAP_S) == 0.0
    assert sorted(set(sched.schedule().req_ids)) == list(range(1, 9))


def test_a_lone_prompt_waits_one_gap_at_most():
    sched = make()
    add(sched, 1, now=5.0)
    assert 0 < sched.arrival_hold_s(5.0) <= ARRIVAL_GAP_S
    assert sched.arrival_hold_s(5.0 + ARRIVAL_GAP_S) == 0.0


def test_the_hold_is_learned_from_the_last_start_from_idle():
    """A start from idle that stayed alone (one user's turns) sends the next lone prompt at once; one that
    others joined, even behind its step in flight, has the next start held again."""
    sched = make()
    add(sched, 1, now=1.0)
    assert sched.arrival_hold_s(1.0) > 0  # the first start is held: a burst may follow
    assert sched.arrival_hold_s(1.0 + ARRIVAL_GAP_S) == 0.0
    _finish(sched)
    add(sched, 2, now=5.0)  # the last start stayed alone
    assert sched.arrival_hold_s(5.0) == 0.0
    assert sched.schedule() is not None  # in flight: a prompt arriving now joins this start
    add(sched, 3, now=5.02)
    _finish(sched)
    add(sched, 4, now=9.0)  # the last start was joined: held again
    assert sched.arrival_hold_s(9.0) == pytest.approx(ARRIVAL_GAP_S)
    assert sched.arrival_hold_s(9.0 + ARRIVAL_GAP_S) == 0.0
    assert sched.schedule() is not None
    add(sched, 5, now=9.2)  # past the start's window: it joined nothing
    _finish(sched)
    add(sched, 6, now=12.0)  # request 4's start stayed alone
    assert sched.arrival_hold_s(12.0) == 0.0


def _finish(sched):
    """Every request admitted, its steps answered and it aborted: the scheduler idle again."""
    while sched.waiting or sched._in_flight:
        if sched._in_flight or sched.schedule() is None:
            sched.fail_in_flight(ServiceUnavailable("the test ends its steps"))
    for rid in list(sched.by_rid):
        sched.abort(rid)
    assert not sched.running and not sched.waiting and not sched._in_flight


def test_no_hold_without_offloaded_experts_with_the_flag_at_zero_or_while_requests_run():
    for sched in (make(offloaded=False), make(coalesce_s=0.0)):
        add(sched, 1, now=1.0)
        assert sched.arrival_hold_s(1.0) == 0.0
    sched = make()
    add(sched, 1, now=1.0)
    assert sched.arrival_hold_s(1.0 + ARRIVAL_GAP_S) == 0.0
    assert sched.schedule() is not None  # request 1 runs from here
    add(sched, 2, now=2.0)
    assert sched.running and sched.arrival_hold_s(2.0) == 0.0  # its next step does not wait for arrivals


def test_the_flag_is_checked():
    assert prefill_coalesce_s(25) == 0.025 and prefill_coalesce_s(0) == 0.0
    with pytest.raises(ConfigError, match="--prefill-coalesce-ms must be between 0 and 1000"):
        prefill_coalesce_s(-1)


def test_as_many_held_prompts_as_may_run_go_at_once():
    """No later arrival could join their step: the eighth of 8 (--max-running-requests 8) ends the hold."""
    sched = make()
    for rid in range(1, 8):
        add(sched, rid, now=40.0 + rid / 1000)
    assert sched.arrival_hold_s(40.008) > 0  # seven wait for more
    add(sched, 8, now=40.008)
    assert sched.arrival_hold_s(40.008) == 0.0
    assert sorted(set(sched.schedule().req_ids)) == list(range(1, 9))
