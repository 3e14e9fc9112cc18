"""A served prompt's time to first token, phase by phase (bench/ttft_path.py): with FERRY_STEP_TRACE, the api
writes when each request reached its handler, was tokenized, went to the scheduler and had its tokens back, and
when its first chunk was written; the scheduler names the api's request id beside its own and the requests of
each step it sends. Together with the worker's step lines, every phase of a one-token completion is found, as
token ids and as text, and the phases add up to the time the client waited."""

from __future__ import annotations

import json
from urllib.parse import urlparse

from bench.ttft_path import PHASES, lines, one_token, phases
from tests.integration.harness import REAL_WORKER_ENV, serve_model


def test_every_phase_of_a_served_first_token_is_traced(tiny_models, tmp_path):
    trace = tmp_path / "trace"
    env = {**REAL_WORKER_ENV, "FERRY_STEP_TRACE": str(trace)}
    with serve_model(tiny_models["qwen3_moe"], tmp_path, env, "--moe-cache-size", "12") as served:
        port = urlparse(served.url).port
        waits = [one_token(port, list(range(20, 120))), one_token(port, "Which ferry leaves the harbour at dawn? " * 8)]
    api, scheduler, worker = (lines(trace, role) for role in ("api", "scheduler", "worker"))
    for sent, first in waits:
        got = phases(sent, first, api, scheduler, worker)
        assert got is not None, json.dumps({"api": api, "scheduler": scheduler, "worker": worker})[:3000]
        assert abs(sum(got[name] for name in PHASES) - got["total"]) < 0.01, got
        assert got["total"] > 0 and got["worker_launch"] > 0, got
    assert [r["prompt_tokens"] for r in api if "submit" in r][0] == 100
