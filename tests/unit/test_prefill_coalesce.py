"""Prompts arriving together share one prefill step when experts are offloaded (batcher.arrival_hold_s,
--prefill-coalesce-ms): each prefill step pays a pass over the experts without a GPU slot, so an idle
scheduler holds new prompts while more keep coming, and never holds a step a running request waits for."""

from __future__ import annotations

import numpy as np
import pytest

from ferry.shared.errors import ConfigError
from ferry.shared.messages import PoolReport
from ferry.shared.sampling import SamplingParams
from ferry.services.scheduler.batcher import ARRIVAL_GAP_S, BatchScheduler
from ferry.services.scheduler.config import prefill_coalesce_s


def make(offloaded=True, coalesce_s=0.025):
    pool = PoolReport(kv_pages=64, page_size=4, linear_state_slots=0, max_running_requests=8, max_prefill_tokens=64,
                      max_model_len=128, experts_offloaded=offloaded)  # fmt: skip
    return BatchScheduler(pool, prefill_coalesce_s=coalesce_s)


def add(sched, rid, now):
    p = np.random.default_rng(rid).integers(10, 200, 6).astype(np.int32)
    return sched.add(rid, b"api", rid, p, SamplingParams(temperature=0), 4, now=now)


def test_a_burst_is_held_while_it_keeps_arriving_and_goes_as_one_step():
    sched = make()
    add(sched, 1, now=10.0)
    assert sched.arrival_hold_s(10.001) == pytest.approx(ARRIVAL_GAP_S - 0.001)
    add(sched, 2, now=10.003)
    add(sched, 3, now=10.005)
    assert sched.arrival_hold_s(10.006) == pytest.approx(10.005 + ARRIVAL_GAP_S - 10.006)
    assert sched.arrival_hold_s(10.005 + ARRIVAL_GAP_S) == 0.0  # the gap passed: they go
    batch = sched.schedule()
    assert sorted(set(batch.req_ids)) == [1, 2, 3]


def test_the_hold_ends_at_the_window_however_long_the_arrivals_go_on():
    sched = make(coalesce_s=0.010)
    for rid, ms in enumerate((0, 3, 6), start=1):  # 3 ms apart, within the 4 ms gap: each one extends the hold
        add(sched, rid, now=20 + ms / 1000)
        assert sched.arrival_hold_s(20 + (ms + 1) / 1000) == pytest.approx(0.003)
    add(sched, 4, now=20.009)
    assert sched.arrival_hold_s(20.0095) == pytest.approx(0.0005)  # cut at 10 ms after the first, not 13
    assert sched.arrival_hold_s(20.010) == 0.0
    assert sorted(set(sched.schedule().req_ids)) == [1, 2, 3, 4]


def test_a_lone_prompt_waits_one_gap_at_most():
    sched = make()
    add(sched, 1, now=5.0)
    assert 0 < sched.arrival_hold_s(5.0) <= ARRIVAL_GAP_S
    assert sched.arrival_hold_s(5.0 + ARRIVAL_GAP_S) == 0.0


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
