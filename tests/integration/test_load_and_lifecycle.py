"""Many clients, disconnects, preemption under a small pool, auth and body limits."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import openai
import pytest

from tests.doubles.paged_model import reference_continuation
from tests.integration.harness import (
    ascii_word_tokens,
    eventually,
    http_get,
    metric,
    start_cluster,
    stream_concurrently,
)


def expected(tok, prompt, n):
    ids = tok.encode(prompt, add_special_tokens=False)
    return tok.decode(reference_continuation(ids, n, ascii_word_tokens(tok)), skip_special_tokens=True)


def run_concurrently(base_url: str, jobs: list[tuple[str, int]], api_key: str = "unused"):
    return stream_concurrently(base_url, jobs, api_key=api_key, ignore_eos=False)


def test_sixteen_concurrent_streams_all_finish_with_the_right_tokens(cluster, tiny_tokenizer):
    jobs = [(f"client {i} says hello", 8 + 3 * i) for i in range(16)]
    results = run_concurrently(cluster.base_url, jobs)
    for (prompt, n), (text, usage, reason) in zip(jobs, results):
        assert usage == n and reason == "length"
        assert text == expected(tiny_tokenizer, prompt, n)


@pytest.fixture(scope="module")
def slow_cluster(slow_model_dir, tmp_path_factory):
    c = start_cluster(slow_model_dir, tmp_path_factory.mktemp("slow"), worker_flags=["--max-model-len", "512"])
    yield c
    c.stop()


def test_client_that_disconnects_mid_stream_frees_its_pages(slow_cluster):
    base = slow_cluster.base_url
    total = metric(base, "ferry_kv_pages_total")

    async def read_a_little_then_leave():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "a long story " * 10, "max_tokens": 400, "stream": True}
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200
                for _ in range(5):
                    await r.content.readline()
                # 400 tokens at 20 ms a step: the request is still running, holding pages
                held = await asyncio.to_thread(eventually, lambda: metric(base, "ferry_kv_pages_available") < total)
                assert held
        # leaving the block closes the connection mid-stream

    asyncio.run(read_a_little_then_leave())
    assert eventually(
        lambda: metric(base, "ferry_running_requests") == 0 and metric(base, "ferry_kv_pages_available") == total
    )
    assert metric(base, "ferry_requests_total") >= 1


def test_preemption_lets_every_request_finish_when_the_pool_is_too_small(tmp_path_factory, model_dir, tiny_tokenizer):
    # 24 pages x 4 tokens = 96 tokens of KV; 8 requests x (~6 prompt + 40 output) need ~370.
    flags = ["--num-pages", "24", "--page-size", "4", "--max-model-len", "64", "--max-running-requests", "8"]
    c = start_cluster(
        model_dir,
        tmp_path_factory.mktemp("small"),
        worker_flags=flags,
        api_flags=["--api-key", "sesame", "--max-body-size", "2KiB"],
    )
    try:
        jobs = [(f"request number {i}", 40) for i in range(8)]
        results = run_concurrently(c.base_url, jobs, api_key="sesame")
        for (prompt, n), (text, usage, reason) in zip(jobs, results):
            assert (usage, reason) == (n, "length")
            assert text == expected(tiny_tokenizer, prompt, n)
        assert eventually(lambda: metric(c.base_url, "ferry_preemptions_total") > 0)
        assert eventually(lambda: metric(c.base_url, "ferry_kv_pages_available") == 24)

        # while we have it: the API key and the body limit
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=c.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert http_get(c.base_url + "/health")[0] == 200  # probes need no key
        req = urllib.request.Request(
            c.base_url + "/v1/completions",
            method="POST",
            data=json.dumps({"prompt": "x" * 4000}).encode(),
            headers={"Authorization": "Bearer sesame", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 413 and "error" in json.loads(info.value.read())
    finally:
        c.stop()


def test_hybrid_model_runs_at_most_one_request_per_linear_state_slot(
    tmp_path_factory, tiny_tokenizer_dir, tiny_tokenizer
):
    from tests.integration.harness import make_model_dir

    model = make_model_dir(
        tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "hybrid", tiny_tokenizer, linear_state_slots=3
    )
    c = start_cluster(model, tmp_path_factory.mktemp("hybrid"), worker_flags=["--max-model-len", "256"])
    try:
        jobs = [(f"same system prompt, user {i}", 12) for i in range(7)]
        results = run_concurrently(c.base_url, jobs)
        for (prompt, n), (text, usage, _) in zip(jobs, results):
            assert usage == n and text == expected(tiny_tokenizer, prompt, n)
        # The double checks every step: a request without a slot, or two requests sharing one (their
        # running hashes would diverge from their KV), fails the step and so the request.
        assert metric(c.base_url, "ferry_preemptions_total") == 0
        assert (
            "ferry_scheduler_kv_pages_cached 0.0" in http_get(f"http://127.0.0.1:{c.scheduler_health_port}/metrics")[1]
        )
    finally:
        c.stop()


def test_client_that_gives_up_on_a_non_streamed_request_frees_its_pages(slow_cluster):
    base = slow_cluster.base_url
    total = metric(base, "ferry_kv_pages_total")

    async def give_up():
        async with aiohttp.ClientSession() as s:
            try:
                body = {"prompt": "patience " * 10, "max_tokens": 400}
                await s.post(base + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.6))
            except asyncio.TimeoutError:
                return
        raise AssertionError("400 tokens at 20 ms a step finished within 0.6 s?")

    asyncio.run(give_up())
    assert eventually(
        lambda: metric(base, "ferry_running_requests") == 0 and metric(base, "ferry_kv_pages_available") == total
    )
