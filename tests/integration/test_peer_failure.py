"""Kill the worker: requests in flight fail within seconds, /health turns 503, nobody hangs."""

from __future__ import annotations

import signal
import time

import openai
import pytest

from tests.integration.harness import (
    assert_new_request_refused,
    eventually,
    health_turns_503,
    http_get,
    kill_worker_mid_streams,
    start_cluster,
)

STEP_S = 15.0  # the hung step: well past --step-timeout 1, with room for a loaded machine before it ends


def test_killing_the_worker_fails_requests_fast_and_health_turns_503(slow_model_dir, tmp_path):
    c = start_cluster(slow_model_dir, tmp_path, worker_flags=["--max-model-len", "512"])
    try:
        kill_worker_mid_streams(c, "doomed")
    finally:
        c.stop()


def test_killing_the_scheduler_turns_api_health_503(model_dir, tmp_path):
    c = start_cluster(model_dir, tmp_path)
    try:
        c.procs["scheduler"].send_signal(signal.SIGKILL)
        health_turns_503(c.base_url, "scheduler")
        assert_new_request_refused(c.base_url)
    finally:
        c.stop()


def test_a_restarted_scheduler_fails_old_requests_and_serves_new_ones(slow_model_dir, tmp_path):
    c = start_cluster(slow_model_dir, tmp_path, worker_flags=["--max-model-len", "512"])
    try:
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.completions.create(model="tiny", prompt="before the restart", max_tokens=400, stream=True)
        next(iter(stream))
        old = c.procs["scheduler"]
        cmd = old.args
        old.send_signal(signal.SIGKILL)
        old.wait()
        c.launch("scheduler", cmd)  # same addresses; the worker and the api reconnect on their own
        t0 = time.monotonic()
        try:
            for _ in stream:
                pass
            raise AssertionError("a stream survived the scheduler that ran it")
        except openai.APIError as exc:
            assert "scheduler" in str(exc)
        assert time.monotonic() - t0 < 15
        assert eventually(lambda: http_get(c.base_url + "/health")[0] == 200, timeout=10)
        r = client.completions.create(model="tiny", prompt="after the restart", max_tokens=5)
        assert r.usage.completion_tokens == 5
    finally:
        c.stop()


@pytest.mark.slow
def test_a_worker_hung_in_one_step_fails_its_requests_and_recovers(
    tmp_path_factory, tiny_tokenizer_dir, tiny_tokenizer
):
    from tests.integration.harness import make_model_dir

    # only the request's step hangs: the step after the recovery (it frees the failed request) runs at once, so
    # the worker stops on SIGTERM instead of being killed after the cluster's 10 s grace
    model = make_model_dir(
        tiny_tokenizer_dir,
        tmp_path_factory.mktemp("models") / "hung",
        tiny_tokenizer,
        step_delay_s=STEP_S,
        delayed_steps=1,
    )
    c = start_cluster(model, tmp_path_factory.mktemp("hung"), scheduler_flags=["--step-timeout", "1"])
    try:
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        t0 = time.monotonic()
        try:
            client.completions.create(model="tiny", prompt="slow", max_tokens=5)
            raise AssertionError("a request finished although every step outlasts --step-timeout")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and "step-timeout" in exc.message
        assert time.monotonic() - t0 < STEP_S - 0.5, "failed only when the step ended, not when it overran"
        status, body = eventually(
            lambda: (lambda r: r if r[0] == 503 else None)(http_get(c.base_url + "/health")), timeout=9.0
        ) or (200, "")
        assert status == 503 and "step-timeout" in body
        assert eventually(
            lambda: http_get(c.base_url + "/health")[0] == 200, timeout=STEP_S * 2
        )  # the step ended: idle again
        c.stop()
        assert c.procs["worker"].returncode == 0, "the recovered worker did not stop on SIGTERM"
    finally:
        c.stop()
