"""The real worker (ferry.services.worker.boot) behind the real api and scheduler, on CPU with the tiny
qwen3_moe model: greedy output through the openai client equals `ferry generate`. The served worker
offloads experts (12 slots for 24 experts) while `ferry generate` keeps all of them resident, so equal
outputs also say offload changes nothing; the expert-cache counters reach the worker's and the api's
/metrics.

Then the serving must-shows against that model (their twins around the PagedHashModel double pin
exact text and step delays): chat, plain and streamed, equals the single-request greedy output of the
same templated prompt (conftest.GreedyReference: `ferry generate`'s code, in this process); 16
concurrent streams each equal their prompt's single-request output; a client that leaves mid-stream
frees its pages; bad input gets a 400 and the server keeps serving; a killed worker fails every
request in flight within 5 s and turns /health 503 (last: it ends the module's cluster).
Preemption under a small pool: test_real_worker_preemption.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import openai
import pytest

from tests.integration.harness import (
    REAL_WORKER_ENV,
    REPO,
    child_env,
    eventually,
    http_get,
    kill_worker_mid_streams,
    labelled_metric,
    metric,
    start_cluster,
    stream_concurrently,
)
from tests.integration.test_bad_input import CASES as BAD_REQUESTS
from tests.integration.test_bad_input import post

PROMPT = "The ferry carries"


def ferry(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ferry.services.cli", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def real_cluster(tiny_models, tmp_path_factory):
    # the session's tiny qwen3_moe checkpoint (the same bytes `ferry make-tiny-model DIR --arch qwen3_moe`
    # writes: tests/unit/test_make_tiny_model.py), built once for the unit tests and these
    c = start_cluster(
        tiny_models["qwen3_moe"],
        tmp_path_factory.mktemp("real-run"),
        worker_flags=["--device", "cpu", "--max-model-len", "512", "--moe-cache-size", "12"],
        boot="ferry.services.worker.boot:boot_worker",
        worker_env=REAL_WORKER_ENV,
    )
    yield c
    c.stop()


def test_greedy_completion_equals_ferry_generate(real_cluster):
    expected = ferry("generate", "--model", str(real_cluster.model_dir), "--prompt", PROMPT, "--max-tokens", "12")
    client = openai.OpenAI(base_url=real_cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected.rstrip("\n")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    )
    assert streamed == r.choices[0].text


def test_chat_streams_and_counts_tokens(real_cluster):
    client = openai.OpenAI(base_url=real_cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens <= 8
    assert chunks[-1].usage.completion_tokens == 8 or any(
        c.choices and c.choices[0].finish_reason == "stop" for c in chunks
    )


def test_expert_cache_counters_reach_worker_and_api_metrics(real_cluster):
    client = openai.OpenAI(base_url=real_cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    worker = f"http://127.0.0.1:{real_cluster.worker_health_port}"
    hits, misses = metric(worker, "ferry_worker_expert_hits_total"), metric(worker, "ferry_worker_expert_misses_total")
    assert hits > 0 and misses > 0, "12 slots for 24 experts: some lookups hit, some miss"
    assert metric(worker, "ferry_worker_expert_copied_bytes_total") == misses * 3 * 32 * 64 * 4  # fp32 gate, up, down
    assert metric(worker, "ferry_worker_expert_slots") == 12
    # the worker's heartbeat carries (hits, misses) through the scheduler to the api's gauge
    eventually(lambda: metric(real_cluster.base_url, "ferry_expert_hit_rate") > 0, timeout=10)
    assert 0 < metric(real_cluster.base_url, "ferry_expert_hit_rate") < 1


def test_worker_log_is_json_lines(real_cluster):
    import json

    lines = [line for line in real_cluster.log("worker").splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]
    by_name = {e["event"]: e for e in events}
    # the plan in a line a person reads (every term: plan_detail at debug); it was 1,300-1,560 characters
    assert all(len(line) < 400 for line, e in zip(lines, events) if e["event"] in ("plan", "worker_ready")), lines
    assert by_name["plan"]["expert_slots"] == 12 and by_name["experts_loaded"]["expert_store"] == "lfu"
    assert by_name["expert_host_banks"]["pinned"] is False  # no CUDA here
    assert by_name["experts_loaded"]["preloaded_slots"] == 12


# ---- the must-shows against the real model (the double-based twins pin exact text and step delays) --------

MESSAGES = [{"role": "system", "content": "You are a ferry."}, {"role": "user", "content": "Carry the experts across."}]


def openai_client(cluster, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=timeout)


def scheduler_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.scheduler_health_port}"


def test_chat_plain_and_streamed_equal_the_single_request_greedy_output(real_cluster, greedy_reference):
    ref = greedy_reference["qwen3_moe"]
    prompt = ref.chat_ids(MESSAGES)  # the chat template applied, as the api does
    ids, reason = ref.ids(prompt, 16, ignore_eos=False)  # eos ends it, as it does in the server
    expected = ref.text(ids)
    assert expected.strip(), "a greedy output with some text to compare"
    client = openai_client(real_cluster)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(ids))
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]
    assert chunks[-1].usage.completion_tokens == len(ids) and chunks[-1].usage.prompt_tokens == len(prompt)


def test_a_reused_prefix_gives_the_same_greedy_output_as_a_fresh_prefill(real_cluster, greedy_reference):
    ref = greedy_reference["qwen3_moe"]
    system = "Only this test sends this harbour master's standing orders to the ferry crew. " * 3  # several pages
    client = openai_client(real_cluster)
    for user in ("first crossing", "second crossing"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        prompt = ref.chat_ids(messages)
        ids, reason = ref.ids(prompt, 10, ignore_eos=False)
        assert ref.text(ids).strip(), "some text to compare"
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ref.text(ids), reason), user
    # the second request's K/V for the shared system prompt came from the first one's pages
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < r.usage.prompt_tokens


def test_sixteen_concurrent_streams_equal_their_single_request_greedy_outputs(real_cluster, greedy_reference):
    ref = greedy_reference["qwen3_moe"]
    prompts = [f"Passenger {i} boards the ferry with {i + 2} crates of experts" for i in range(8)]
    jobs = [(prompts[i % 8], 12 if i < 8 else 20) for i in range(16)]  # each prompt twice, two lengths
    alone = {p: ref.ids(ref.text_ids(p), 20)[0] for p in prompts}
    sched = scheduler_url(real_cluster)
    steps_before = metric(sched, "ferry_scheduler_steps_total")
    ahead_before = metric(sched, "ferry_scheduler_steps_ahead_total")
    results = stream_concurrently(real_cluster.base_url, jobs)
    for (prompt, n), (text, usage, reason) in zip(jobs, results):
        assert (usage, reason) == (n, "length"), prompt
        assert text == ref.text(alone[prompt][:n]), f"batching changed the greedy output of {prompt!r}"
    # they really ran together: one at a time would take at least one step per generated token
    assert metric(sched, "ferry_scheduler_steps_total") - steps_before < sum(n for _, n in jobs) / 2
    # and decode steps went out ahead of their predecessors' answers, the worker feeding them its samples
    assert metric(sched, "ferry_scheduler_steps_ahead_total") - ahead_before > 0


def test_client_that_disconnects_mid_stream_frees_its_pages(real_cluster):
    base, sched = real_cluster.base_url, scheduler_url(real_cluster)
    total = metric(sched, "ferry_scheduler_kv_pages_total")
    # nothing else runs: every page is free or cached-and-unreferenced (the gauge travels on 0.5 s heartbeats)
    assert eventually(lambda: metric(sched, "ferry_scheduler_kv_pages_available") == total)
    left_before = labelled_metric(base, "ferry_requests_total", route="completions", outcome="disconnected")
    steps_before = metric(sched, "ferry_scheduler_steps_total")  # counted as each step is sent: no heartbeat lag
    max_tokens = 440

    async def read_a_little_then_leave():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            body = {"prompt": "a long crossing " * 10, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200
                for _ in range(5):
                    assert (await r.content.readline()).startswith(b"data: ")
                    await r.content.readline()  # the blank line after each event
        # leaving the blocks closes the connection mid-stream

    asyncio.run(read_a_little_then_leave())
    last = [-1.0]

    def no_more_steps() -> bool:
        now = metric(sched, "ferry_scheduler_steps_total")
        settled, last[0] = now == last[0], now
        return settled

    assert eventually(no_more_steps, timeout=30, interval=0.3)
    # one step per token: run to its end, the request would have taken 440 steps; it was cut short
    assert last[0] - steps_before < max_tokens // 2, "the scheduler kept generating for a client that left"
    assert eventually(
        lambda: (
            metric(sched, "ferry_scheduler_running_requests") == 0
            and metric(sched, "ferry_scheduler_kv_pages_available") == total
        )
    )
    assert eventually(lambda: metric(base, "ferry_kv_cache_usage") == 0)
    assert labelled_metric(base, "ferry_requests_total", route="completions", outcome="disconnected") == left_before + 1


@pytest.mark.parametrize("path,body,needle", BAD_REQUESTS)
def test_bad_request_gets_400_with_an_openai_error(real_cluster, path, body, needle):
    status, payload = post(real_cluster.base_url, path, body)
    assert status == 400, payload
    err = payload["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"], err


def test_server_keeps_serving_after_bad_requests(real_cluster, greedy_reference):
    for path, body, _ in BAD_REQUESTS:
        post(real_cluster.base_url, path, body)
    ref = greedy_reference["qwen3_moe"]
    status, payload = post(
        real_cluster.base_url,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200 and payload["usage"]["completion_tokens"] == 5
    assert payload["choices"][0]["text"] == ref.text(ref.ids(ref.text_ids(PROMPT), 5)[0])
    assert http_get(real_cluster.base_url + "/health")[0] == 200


def test_a_prompt_one_token_short_of_the_model_length_gets_one_token(real_cluster, greedy_reference):
    ref = greedy_reference["qwen3_moe"]
    prompt = [3 + i % 600 for i in range(511)]  # the model length is 512
    status, payload = post(
        real_cluster.base_url,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, payload
    assert payload["usage"]["completion_tokens"] == 1 and payload["choices"][0]["finish_reason"] == "length"
    assert payload["choices"][0]["text"] == ref.text(ref.ids(prompt, 1)[0])
    status, payload = post(real_cluster.base_url, "/v1/completions", {"prompt": prompt + [3], "max_tokens": 1})
    assert status == 400 and "no room for a single output token" in payload["error"]["message"]


# Kills the module's worker: keep it the last test of this module.
def test_killing_the_real_worker_fails_requests_fast_and_health_turns_503(real_cluster):
    kill_worker_mid_streams(real_cluster, "doomed crossing", extra_body={"ignore_eos": True})
