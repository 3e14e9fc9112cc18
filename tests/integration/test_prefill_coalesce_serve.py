"""Prompts sent together share one prefill step when experts are offloaded (`--prefill-coalesce-ms`,
BatchScheduler.arrival_hold_s), through `ferry serve` and eight official openai clients started at once:
the worker's step trace (FERRY_STEP_TRACE) shows their prompts in one step, and without the hold in
several. The clients are spread 40 ms apart, and the window is wide (900 ms, so 300 ms between arrivals),
so that a loaded 2-core CI machine stays inside it; the default's sizing against a measured burst is in
tests/unit/test_prefill_coalesce.py."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from tests.integration.harness import REAL_WORKER_ENV, serve_model


def _steps(trace_dir):
    lines = [json.loads(x) for f in trace_dir.glob("worker-*.jsonl") for x in f.read_text().splitlines()]
    return [x for x in lines if "rows" in x]


def _first_step_of_eight_clients(model_dir, tmp_path, coalesce_ms: str) -> tuple[dict, list[int]]:
    trace = tmp_path / "trace"
    env = {**REAL_WORKER_ENV, "FERRY_STEP_TRACE": str(trace)}
    flags = ("--moe-cache-size", "12", "--prefill-coalesce-ms", coalesce_ms)  # offloaded: 12 slots of the experts
    with serve_model(model_dir, tmp_path, env, *flags) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)

        def ask(i: int) -> int:
            time.sleep(0.04 * i)  # a burst spread over 280 ms, 40 ms apart: each step alone would be one prompt
            r = client.chat.completions.create(
                model="tiny",
                max_tokens=2,
                temperature=0,
                messages=[{"role": "user", "content": f"Question {i}: which ferry leaves the harbour at dawn?"}],
            )
            return r.usage.prompt_tokens

        with ThreadPoolExecutor(8) as pool:
            prompt_tokens = list(pool.map(ask, range(8)))
    steps = _steps(trace)  # the processes flushed their traces as they stopped
    assert steps, "the worker wrote no step trace"
    return steps[0], prompt_tokens


def test_eight_clients_sent_together_are_prefilled_in_one_step(tiny_models, tmp_path):
    first, prompt_tokens = _first_step_of_eight_clients(tiny_models["qwen3_moe"], tmp_path, "900")
    # all eight prompts in the first served step, whole (each fits the step's token budget)
    assert (first["rows"], first["tokens"]) == (8, sum(prompt_tokens)), first


def test_without_the_hold_the_first_prompt_goes_alone(tiny_models, tmp_path):
    first, _ = _first_step_of_eight_clients(tiny_models["qwen3_moe"], tmp_path, "0")
    assert first["rows"] < 8, first  # the others arrived while it ran: the hold is what joins them
