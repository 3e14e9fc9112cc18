"""Kill the worker: requests in flight fail within 5 s, /health turns 503, nobody hangs."""

from __future__ import annotations

import asyncio
import signal
import time

import openai

from tests.integration.harness import assert_new_request_refused, eventually, health_turns_503, http_get, start_cluster


def test_killing_the_worker_fails_requests_fast_and_health_turns_503(slow_model_dir, tmp_path):
    c = start_cluster(slow_model_dir, tmp_path, worker_flags=["--max-model-len", "512"])
    try:
        client = openai.AsyncOpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=30)

        async def one(i: int, started: asyncio.Event):
            try:
                stream = await client.completions.create(model="tiny", prompt=f"doomed {i}", max_tokens=400, stream=True)
                async for _ in stream:
                    started.set()
            except openai.APIError as exc:
                return time.monotonic(), exc
            return time.monotonic(), None

        async def main():
            started = asyncio.Event()
            streams = [asyncio.create_task(one(i, started)) for i in range(4)]
            plain = asyncio.create_task(client.completions.create(model="tiny", prompt="doomed too", max_tokens=400))
            await asyncio.wait_for(started.wait(), 10)
            await asyncio.sleep(0.2)
            c.procs["worker"].send_signal(signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*streams), 10)
            try:
                await asyncio.wait_for(plain, 10)
                plain_error = None
            except openai.APIStatusError as exc:
                plain_error = exc
            await client.close()
            return killed, results, plain_error

        killed, results, plain_error = asyncio.run(main())
        for ended, err in results:
            assert err is not None, "a stream finished normally although its worker died"
            assert "worker" in str(err)
            assert ended - killed < 5.0
        assert plain_error is not None and plain_error.status_code == 503 and "worker" in plain_error.message
        health_turns_503(c.base_url, "worker")
        assert_new_request_refused(c.base_url)
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
        assert time.monotonic() - t0 < 5
        assert eventually(lambda: http_get(c.base_url + "/health")[0] == 200, timeout=10)
        r = client.completions.create(model="tiny", prompt="after the restart", max_tokens=5)
        assert r.usage.completion_tokens == 5
    finally:
        c.stop()


def test_a_worker_hung_in_one_step_fails_its_requests_and_recovers(tmp_path_factory, tiny_tokenizer_dir, tiny_tokenizer):
    from tests.integration.harness import make_model_dir

    model = make_model_dir(tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "hung", tiny_tokenizer,
                           step_delay_s=6.0)  # fmt: skip
    c = start_cluster(model, tmp_path_factory.mktemp("hung"), scheduler_flags=["--step-timeout", "1"])
    try:
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        t0 = time.monotonic()
        try:
            client.completions.create(model="tiny", prompt="slow", max_tokens=5)
            raise AssertionError("a request finished although every step outlasts --step-timeout")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and "step-timeout" in exc.message
        assert time.monotonic() - t0 < 5.5, "failed only when the step ended, not when it overran"
        status, body = eventually(lambda: (lambda r: r if r[0] == 503 else None)(http_get(c.base_url + "/health")),
                                  timeout=3.0) or (200, "")  # fmt: skip
        assert status == 503 and "step-timeout" in body
        assert eventually(lambda: http_get(c.base_url + "/health")[0] == 200, timeout=12)  # the step ended: idle again
    finally:
        c.stop()
