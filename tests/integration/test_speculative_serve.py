"""--speculative-method ngram through real processes (the real worker on CPU, both tiny models, the OpenAI
client): concurrent greedy completions, one of two choices, one ending on a stop string and a seeded one beside
them, give exactly
the text they give without speculation, and the scheduler's and the api's /metrics count the drafts (the
attention-only model's: the hybrid's random weights rarely repeat themselves, so prompt lookup seldom drafts).
--speculative-method mtp likewise, on a tiny Qwen3.5 MoE with an MTP layer."""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

from ferry.services.make_tiny_model import make_tiny_model
from tests.integration.harness import REAL_WORKER_ENV, health_turns_503, metric, start_cluster

REAL_BOOT = "ferry.services.worker.boot:boot_worker"
FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256"]
# prompts that repeat themselves, as a quoted list or a loop does: prompt lookup finds drafts in them
PROMPTS = ["one two three one two three one two", "a b c d a b c d a b", "the tide the tide the", "x y x y x y x"]


def completions(c, stop: str | None = None) -> list[str]:
    client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=120)

    def one(i: int) -> str:
        extra = {"temperature": 0.9, "seed": 5} if i == 3 else {"temperature": 0}
        if i == 2 and stop is not None:
            extra["stop"] = [stop]
        if i == 1:
            extra["n"] = 2  # two choices of one prompt: two requests, each speculating on its own
        got = client.completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=24, extra_body={"ignore_eos": True}, **extra
        )
        return "|".join(c.text for c in sorted(got.choices, key=lambda c: c.index))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def scheduler_metric(c, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{c.scheduler_health_port}/metrics", timeout=10) as r:
        m = re.search(rf"^{name} (\S+)$", r.read().decode(), re.M)
    return float(m[1]) if m else 0.0


def test_ngram_speculation_serves_the_text_of_none(tiny_model, tmp_path):
    """One worker and api; the scheduler started without speculation, then stopped and started again with
    --speculative-method ngram (the worker and the api reconnect on their own)."""
    c = start_cluster(
        tiny_model, tmp_path / "run", worker_flags=FLAGS, boot=REAL_BOOT, worker_env=REAL_WORKER_ENV, wait=False
    )
    got = {}
    try:
        c.wait_ready(timeout=180)
        got["off"] = completions(c)
        stop = got["off"][2][len(got["off"][2]) // 2 :][:3]  # a string from the middle of the third text
        got["off_stop"] = completions(c, stop)
        old = c.procs["scheduler"]
        old.send_signal(signal.SIGTERM)
        assert old.wait(timeout=30) == 0
        health_turns_503(c.base_url, "scheduler")
        c.launch("scheduler", [*old.args, "--speculative-method", "ngram", "--speculative-tokens", "3"])
        c.wait_ready(timeout=60)
        got["ngram"] = completions(c)
        got["ngram_stop"] = completions(c, stop)
        # the counts reach /metrics with the next heartbeats (every 0.5 s): both sides the same once they settle
        deadline = time.monotonic() + 20
        while True:
            drafted = scheduler_metric(c, "ferry_scheduler_drafted_tokens_total")
            accepted = scheduler_metric(c, "ferry_scheduler_accepted_drafts_total")
            api_drafted = metric(c.base_url, "ferry_speculative_drafted_tokens_total")
            decisions = scheduler_metric(c, "ferry_scheduler_draft_decisions_total")  # the draft-length controller's
            api_decisions = metric(c.base_url, "ferry_speculative_k_decisions_total")
            # the scheduler exports its counts with its status: a first look may find both sides still at 0
            settled = api_drafted == drafted and api_decisions == decisions > 0
            settled = settled and (drafted > 0 or tiny_model.name != "qwen3_moe")
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        c.stop()
    assert "step_failed" not in c.log("worker"), c.log("worker")[-2000:]
    assert got["ngram"] == got["off"], got
    assert got["ngram_stop"] == got["off_stop"] and stop not in got["off_stop"][2], got
    # the attention-only tiny model's greedy text falls into loops, which prompt lookup drafts from; the hybrid's
    # random weights rarely repeat themselves (tests/unit/test_speculative_decoding.py drafts for it by hand)
    assert drafted > 0 if tiny_model.name == "qwen3_moe" else drafted >= 0
    assert 0 <= accepted <= drafted
    assert api_drafted == drafted  # the scheduler's heartbeat carries its counts to the api's /metrics
    assert api_decisions == decisions > 0  # every decoding row that may draft is given a k, 0 included


def test_mtp_speculation_serves_the_text_of_none(tmp_path):
    """--speculative-method mtp through the real processes, on a tiny Qwen3.5 MoE with an MTP layer: the worker
    plans and loads the head and drafts with it after every step; greedy completions give the text of a scheduler
    that sends no drafts, and the scheduler's /metrics count the rows it sent with the head's drafts."""
    model = make_tiny_model(tmp_path / "qwen3_5_moe_mtp", "qwen3_5_moe", seed=0, mtp=True)
    worker_flags = [*FLAGS, "--speculative-method", "mtp"]
    c = start_cluster(
        model, tmp_path / "run", worker_flags=worker_flags, boot=REAL_BOOT, worker_env=REAL_WORKER_ENV, wait=False
    )
    got = {}
    try:
        c.wait_ready(timeout=180)
        got["off"] = completions(c)
        old = c.procs["scheduler"]
        old.send_signal(signal.SIGTERM)
        assert old.wait(timeout=30) == 0
        health_turns_503(c.base_url, "scheduler")
        c.launch("scheduler", [*old.args, "--speculative-method", "mtp", "--speculative-tokens", "3"])
        c.wait_ready(timeout=60)
        got["mtp"] = completions(c)
        deadline = time.monotonic() + 20
        while (drafted := scheduler_metric(c, "ferry_scheduler_drafted_tokens_total")) == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        c.stop()
    assert "step_failed" not in c.log("worker"), c.log("worker")[-2000:]
    assert got["mtp"] == got["off"], got
    assert drafted > 0
