"""The bench's oracle drafter (services/scheduler/oracle_drafter.py): the target's own greedy continuation,
corrupted at rate 1 - alpha, reachable only through FERRY_BENCH_* variables with FERRY_BENCH_ONLY=1."""

from __future__ import annotations

import pytest
import zmq

from ferry.services import serve_command
from ferry.services.scheduler.batcher import BatchScheduler, Outcome
from ferry.services.scheduler.config import SchedulerConfig, scheduler_config_from_args
from ferry.services.scheduler.oracle_drafter import (
    ALPHA_ENV,
    BENCH_ENV,
    ORACLE_ENV,
    PINNED_ENV,
    RECORD_ENV,
    BenchDrafts,
    OracleDrafter,
    bench_drafts_from_env,
    record_sequence,
)
from ferry.services.scheduler.request import Request
from ferry.services.scheduler.service import SchedulerService
from ferry.shared.errors import ConfigError
from ferry.shared.messages import Submit
from ferry.shared.sampling import SamplingParams
from tests.unit.test_cli_flags import parse
from tests.unit.test_draft_length import pool
from tests.unit.test_speculative_decoding import GREEDY, PROMPTS, boot, generate

BENCH_VARS = (BENCH_ENV, RECORD_ENV, ORACLE_ENV, ALPHA_ENV, PINNED_ENV)


def request(rid: int, tokens: list[int], prompt_len: int) -> Request:
    return Request(rid, b"t", rid, prompt_len, GREEDY, 64, tokens)


def recorded(executor, plan, tmp_path, max_tokens=30):
    """The greedy outputs of speculation off, recorded as the served scheduler does at each finish."""
    requests = [(p, GREEDY, max_tokens) for p in PROMPTS[:3]]
    off, _ = generate(executor, plan, requests)
    path = tmp_path / "sequences.jsonl"
    for p, (tokens, _) in zip(PROMPTS, off):
        req = request(1, [*p, *tokens], len(p))
        record_sequence(str(path), req)
    return requests, off, str(path)


def test_the_oracle_at_alpha_one_has_every_draft_kept_and_at_zero_none(tiny_models, tmp_path):
    executor, plan = boot(tiny_models["qwen3_moe"])
    requests, off, path = recorded(executor, plan, tmp_path)
    sequences = OracleDrafter.read(path)
    assert len(sequences) == 3
    vocab = executor.spec.vocab_size
    on, sched = generate(executor, plan, requests, "ngram", k=4, drafter=OracleDrafter(sequences, 1.0, vocab))
    assert on == off
    assert sched.drafted_tokens > 20 and sched.accepted_drafts == sched.drafted_tokens
    on, sched = generate(executor, plan, requests, "ngram", k=4, drafter=OracleDrafter(sequences, 0.0, vocab))
    assert on == off
    assert sched.drafted_tokens > 0 and sched.accepted_drafts == 0


def test_the_oracle_keeps_about_alpha_of_its_drafts():
    """Each draft corrupted at rate 1 - alpha, independently: over many calls about alpha of them are the
    recorded token, and a request off the recorded path (or not recorded) gets none."""
    output = list(range(100, 140))
    oracle = OracleDrafter({(1, 2, 3): output}, 0.8, vocab_size=1000)
    req = request(1, [1, 2, 3, 100, 101], 3)
    same = total = 0
    for _ in range(500):
        drafts = oracle(req, 4)
        assert len(drafts) == 4 and all(0 <= t < 1000 for t in drafts)
        same += sum(d == t for d, t in zip(drafts, output[2:6]))
        total += 4
    assert 0.75 < same / total < 0.85
    assert oracle(request(2, [1, 2, 3, 100, 7], 3), 4) == []
    assert oracle(request(3, [9, 9, 100], 2), 4) == []


@pytest.mark.parametrize("var", [RECORD_ENV, ORACLE_ENV, ALPHA_ENV, PINNED_ENV])
def test_the_bench_switches_are_refused_without_the_bench_env(monkeypatch, tmp_path, var):
    """Neither `ferry serve` nor `ferry scheduler` starts with a bench switch unless FERRY_BENCH_ONLY=1."""
    path = tmp_path / "s.jsonl"
    path.write_text("")
    for name in BENCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(var, {ALPHA_ENV: "0.5", PINNED_ENV: "2"}.get(var, str(path)))
    flags = ("--speculative-method", "ngram")
    with pytest.raises(ConfigError, match=f"{var}.*{BENCH_ENV}=1"):
        scheduler_config_from_args(parse("scheduler", *flags))
    with pytest.raises(ConfigError, match=BENCH_ENV):
        serve_command.run(parse("serve", "/models/m", *flags))


def test_the_bench_switches_checked(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("")
    bench = {BENCH_ENV: "1"}
    assert bench_drafts_from_env({}, "ngram") == BenchDrafts()
    assert bench_drafts_from_env({**bench, ORACLE_ENV: str(path), ALPHA_ENV: "0.6"}, "ngram") == BenchDrafts(
        oracle_path=str(path), alpha=0.6
    )
    assert bench_drafts_from_env({**bench, RECORD_ENV: str(path)}, "off").record_path == str(path)
    with pytest.raises(ConfigError, match="--speculative-method ngram"):
        bench_drafts_from_env({**bench, ORACLE_ENV: str(path)}, "off")
    for bad in ("1.5", "-0.1", "most"):
        with pytest.raises(ConfigError, match=ALPHA_ENV):
            bench_drafts_from_env({**bench, ORACLE_ENV: str(path), ALPHA_ENV: bad}, "ngram")
    with pytest.raises(ConfigError, match="no such file"):
        bench_drafts_from_env({**bench, ORACLE_ENV: str(tmp_path / "none")}, "ngram")
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match=ORACLE_ENV):
        OracleDrafter.read(str(path))
    assert bench_drafts_from_env({**bench, PINNED_ENV: "3"}, "mtp") == BenchDrafts(pinned_drafts=3)
    for bad in ("0", "17", "two", "-1", "1.5"):
        with pytest.raises(ConfigError, match=f"{PINNED_ENV} must be a whole number from 1 to 16"):
            bench_drafts_from_env({**bench, PINNED_ENV: bad}, "mtp")
    with pytest.raises(ConfigError, match=f"{PINNED_ENV}.*--speculative-method ngram or mtp"):
        bench_drafts_from_env({**bench, PINNED_ENV: "2"}, "off")


def test_pinned_drafts_give_every_drafting_row_k_whatever_the_prices():
    """FERRY_BENCH_PINNED_DRAFTS reaches the controller through the scheduler: every row drafts min(k, K, what the
    step leaves) at prices under which the controller alone drafts nothing."""
    ctl = BatchScheduler(pool(vocab_size=100), speculative_method="ngram", speculative_tokens=4).draft_length
    pinned = BatchScheduler(
        pool(vocab_size=100), speculative_method="ngram", speculative_tokens=4, pinned_drafts=3
    ).draft_length
    for c in (ctl, pinned):
        c.note_step_costs(1e-3, 0.0, 9e-3)  # a verify step 8 ms dearer than a replay: no k pays
    assert ctl.best(0.8, rows=1, step_tokens=1, limit=4) == 0
    assert pinned.best(0.8, rows=1, step_tokens=1, limit=4) == 3
    assert pinned.best(0.0, rows=8, step_tokens=8, limit=2) == 2
    assert pinned.choose(7, rows=1, step_tokens=1, limit=4) == 3


def test_a_served_request_cannot_turn_the_oracle_on(monkeypatch):
    """The oracle is the scheduler's start-up switch alone: nothing a request carries to the scheduler names
    it, and a scheduler started without the variables drafts by prompt lookup for every request."""
    for name in BENCH_VARS:
        monkeypatch.delenv(name, raising=False)
    wire_fields = (*Submit.__struct_fields__, *SamplingParams.__struct_fields__)
    assert not [f for f in wire_fields if "oracle" in f or "bench" in f or "draft" in f]
    cfg = scheduler_config_from_args(parse("scheduler", "--speculative-method", "ngram", "--insecure-wire"))
    assert cfg.bench_drafts == BenchDrafts()


def scheduler_service(tmp_path, bench: BenchDrafts) -> SchedulerService:
    cfg = SchedulerConfig(
        api_addr=f"ipc://{tmp_path}/api",
        steps_addr=f"ipc://{tmp_path}/steps",
        results_addr=f"ipc://{tmp_path}/results",
        health_host="127.0.0.1",
        health_port=None,
        step_timeout_s=60,
        bench_drafts=bench,
    )
    return SchedulerService(cfg, zmq.Context())


def test_the_scheduler_records_finished_requests_and_drafts_from_the_record(tmp_path):
    """FERRY_BENCH_RECORD_SEQUENCES: each finished request's tokens reach the file; FERRY_BENCH_ORACLE_DRAFTS:
    the scheduler's drafter is the oracle over that file (prompt lookup without it)."""
    path = tmp_path / "s.jsonl"
    svc = scheduler_service(tmp_path, BenchDrafts(record_path=str(path)))
    svc._send = lambda client, msg: None
    svc._emit(Outcome(finished=[(request(4, [1, 2, 3, 50, 51], 3), "length")]))
    assert OracleDrafter.read(str(path)) == {(1, 2, 3): [50, 51]}
    assert svc._oracle_drafter(pool(vocab_size=100)) is None
    svc = scheduler_service(tmp_path, BenchDrafts(oracle_path=str(path), alpha=1.0))
    drafter = svc._oracle_drafter(pool(vocab_size=100))
    assert drafter(request(5, [1, 2, 3, 50], 3), 4) == [51]
    path.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match=ORACLE_ENV):  # a bad record stops the scheduler at start
        scheduler_service(tmp_path, BenchDrafts(oracle_path=str(path)))
