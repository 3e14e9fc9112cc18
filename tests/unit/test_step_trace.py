"""FERRY_STEP_TRACE: off, nothing is kept or written; on, one JSON line per event in <role>-<pid>.jsonl,
and a served step's lines from the scheduler and the worker fold into one timeline (bench/profile_serve.py)."""

from __future__ import annotations

import json
import os

import pytest

from bench.profile_serve import timeline
from ferry.shared.step_trace import StepTrace


def test_off_unless_the_variable_names_a_directory(tmp_path):
    trace = StepTrace("worker", environ={})
    trace.add(step=1, recv=0.5)
    trace.flush()
    assert not trace.enabled and trace._lines == [] and list(tmp_path.iterdir()) == []


def test_lines_are_appended_per_process(tmp_path):
    trace = StepTrace("scheduler", environ={"FERRY_STEP_TRACE": str(tmp_path / "t")})
    trace.add(step=1, sent=1.0)
    trace.add(step=1, landed=2.0)
    trace.flush()
    trace.flush()
    lines = (tmp_path / "t" / f"scheduler-{os.getpid()}.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "sent": 1.0}, {"step": 1, "landed": 2.0}]


def test_the_timeline_of_steps_scheduled_ahead():
    """Steps 1..6 one ms apart on the device, each sent ahead when the answer two before it landed."""
    sched, worker = [], []
    for k in range(1, 7):
        sent = k * 1.0e-3 - 0.9e-3
        sched.append({"step": k, "sent": sent})
        recv = sent + 0.05e-3
        answered = k * 1.0e-3 + 0.02e-3
        worker.append(
            {
                "step": k,
                "rows": 1,
                "tokens": 1,
                "recv": recv,
                "launched": recv + 0.2e-3,
                "answered": answered,
                "device_ms": 1.0,
                "idle_ms": 0.0,
            }
        )
        sched.append({"step": k, "landed": answered + 0.03e-3})
    t = timeline(sched, worker, 0.0, 1.0)
    assert t["steps"] == 6 and t["device_ms"] == 1.0 and t["device_idle_ms"] == 0.0
    assert abs(t["worker_launch_ms"] - 0.2) < 1e-9 and abs(t["sent_to_worker_read_ms"] - 0.05) < 1e-9
    assert abs(t["answer_to_scheduler_ms"] - 0.03) < 1e-9 and abs(t["step_interval_ms"] - 1.0) < 1e-9
    # step k+2 was sent (k+1.1 ms) after step k's answer landed (k + 0.05 ms)
    assert abs(t["scheduler_turn_ms"] - 1.05) < 1e-9


def test_the_timeline_shows_a_tail_the_median_hides():
    """Nine intervals of 1 ms and one of 11 ms: the median says 1, the mean (the served rate) 2."""
    worker, at = [], 0.0
    for k in range(11):
        at += 11e-3 if k == 6 else 1e-3
        worker.append(
            {
                "step": k,
                "rows": 1,
                "tokens": 1,
                "recv": at - 0.5e-3,
                "launched": at - 0.4e-3,
                "answered": at,
                "device_ms": None,
                "idle_ms": None,
            }
        )
    t = timeline([], worker, 0.0, 1.0)
    assert abs(t["step_interval_ms"] - 1.0) < 1e-9 and abs(t["step_interval_mean_ms"] - 2.0) < 1e-9
    assert abs(t["step_interval_max_ms"] - 11.0) < 1e-9 and abs(t["step_interval_p90_ms"] - 1.0) < 1e-9


def test_the_oracle_bench_splits_the_steps_by_kind():
    """bench/speculation_oracle.py's `step_kinds`: a plain step, a drafting one and a row of several tokens without
    drafts, each charged the interval since the answer before it; steps outside the window are left out."""
    from bench.speculation_oracle import step_kinds

    def step(n, answered, tokens, drafts, longest, device):
        return dict(step=n, rows=1, tokens=tokens, drafts=drafts, longest=longest, answered=answered,
                    device_ms=device, idle_ms=0.5)  # fmt: skip

    worker = [
        step(1, 0.000, 1, 0, 1, 1.0),
        step(2, 0.001, 1, 0, 1, 1.0),
        step(3, 0.009, 5, 4, 5, 6.0),  # a drafting step: 8 ms since the answer before it
        step(4, 0.039, 8, 0, 8, 29.0),  # a hybrid's kept tokens again, eager: 30 ms
        step(5, 0.040, 1, 0, 1, 1.0),
        step(6, 9.000, 1, 0, 1, 1.0),  # past the window
    ]
    kinds = step_kinds(worker, 0.0, 1.0)
    assert kinds["plain"]["steps"] == 2 and kinds["plain"]["interval_ms"] == pytest.approx(1.0)
    assert kinds["drafting"] == {
        "steps": 1,
        "seconds": pytest.approx(0.008),
        "interval_ms": pytest.approx(8.0),
        "device_ms": 6.0,
        "device_idle_ms": 0.5,
        "longest_row": 5,
    }
    assert kinds["several"]["seconds"] == pytest.approx(0.03) and kinds["several"]["longest_row"] == 8
