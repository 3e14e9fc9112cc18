"""--schedule-ahead-steps through real processes (the real worker on CPU, the tiny model, the OpenAI client):
with up to three decode steps out beyond the oldest unanswered one, each fed on the worker by the tokens the
step before it samples, concurrent greedy and seeded completions give exactly the text they give with no
step sent ahead, and the scheduler counts the steps it sent ahead."""

from __future__ import annotations

import re
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

from tests.integration.harness import REAL_WORKER_ENV, health_turns_503, start_cluster

REAL_BOOT = "ferry.services.worker.boot:boot_worker"
FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256"]
PROMPTS = ["the ferry leaves at", "tide tables for the", "a lantern on the quay", "one two three four"]


def completions(c) -> list[str]:
    client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=120)

    def one(i: int) -> str:
        seeded = {"temperature": 0.9, "seed": 11 + i} if i % 2 else {"temperature": 0}
        # different lengths, so requests end while the steps after their last are in flight
        got = client.completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=9 + 5 * i, extra_body={"ignore_eos": True}, **seeded
        )
        return got.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def steps_ahead(c) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{c.scheduler_health_port}/metrics", timeout=10) as r:
        m = re.search(r"^ferry_scheduler_steps_ahead_total (\S+)$", r.read().decode(), re.M)
    return float(m[1]) if m else 0.0


def test_three_steps_ahead_serve_the_text_of_none_ahead(tiny_model, tmp_path):
    """One worker and api; the scheduler started with no step ahead, then stopped and started again with three
    (the worker and the api reconnect on their own): a second boot of the model would compare nothing more."""
    c = start_cluster(
        tiny_model,
        tmp_path / "run",
        worker_flags=FLAGS,
        scheduler_flags=["--no-schedule-ahead"],
        boot=REAL_BOOT,
        worker_env=REAL_WORKER_ENV,
        wait=False,
    )
    got, ahead = {}, {}
    try:
        c.wait_ready(timeout=180)
        got["none"], ahead["none"] = completions(c), steps_ahead(c)
        old = c.procs["scheduler"]
        old.send_signal(signal.SIGTERM)
        assert old.wait(timeout=30) == 0
        health_turns_503(c.base_url, "scheduler")  # the api saw it go: its next ready is the new scheduler's
        cmd = [*old.args[: old.args.index("--no-schedule-ahead")], "--schedule-ahead-steps", "3"]
        c.launch("scheduler", cmd)
        c.wait_ready(timeout=60)
        got["three"], ahead["three"] = completions(c), steps_ahead(c)
    finally:
        c.stop()
    assert "step_failed" not in c.log("worker"), c.log("worker")[-2000:]
    assert got["three"] == got["none"], got
    assert ahead["none"] == 0 and ahead["three"] > 0, ahead
