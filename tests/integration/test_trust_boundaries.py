"""Issue 13's reproduced failures, one test each (numbered as in the issue), against the real api,
scheduler and worker processes around the PagedHashModel double: a message that breaks the contract is
answered for its request alone, a rogue peer gets nothing and changes nothing, the HTTP edge refuses
what it cannot serve with a 4xx naming the field, and nothing hangs. Loopback and ipc only."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import numpy as np
import openai
import pytest
import zmq
import zmq.auth

from ferry.shared.messages import Failed, PoolReport, Submit, WorkerAlive
from ferry.shared.sampling import SamplingParams
from tests.integration.harness import (
    REPO,
    api_command,
    child_env,
    http_get,
    labelled_metric,
    make_model_dir,
    start_cluster,
    stream_concurrently,
)
from tests.integration.test_bad_input import post
from tests.integration.wire_peers import peer, replies, send

FORGED_POOL = PoolReport(
    kv_pages=8, page_size=16, linear_state_slots=0, max_running_requests=64, max_prefill_tokens=8192, max_model_len=512
)


@pytest.fixture(scope="module")
def paced_model_dir(tmp_path_factory, tiny_tokenizer_dir, tiny_tokenizer):
    """Steps take 20 ms: concurrent requests share steps, and a stream lasts long enough to act during it."""
    return make_model_dir(tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "paced", tiny_tokenizer, 0.02)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """CURVE key pairs, as `ferry keys DIR` writes them (pyzmq's certificate files)."""
    d = tmp_path_factory.mktemp("keys")
    for role in ("scheduler", "api", "worker"):
        zmq.auth.create_certificates(str(d), role)
    return d


def _load(keys, role):
    return zmq.auth.load_certificate(str(keys / f"{role}.key_secret"))


@pytest.fixture(scope="module")
def ipc(paced_model_dir, tmp_path_factory):
    """The ipc layout (`ferry serve`'s): the raw peers below reach its sockets as this user can."""
    c = start_cluster(
        paced_model_dir,
        tmp_path_factory.mktemp("ipc"),
        worker_flags=["--max-model-len", "512"],
        env={"FERRY_READ_TIMEOUT": "2", "FERRY_DRAIN_TIMEOUT": "20"},
    )
    yield c
    c.stop()


@pytest.fixture
def tcp(paced_model_dir, tmp_path_factory, keys):
    """The tcp layout on loopback, as compose wires it, with the CURVE keys; one per test (a rogue peer
    that wedged or killed the scheduler of old must not fail the next test for its own reason)."""
    c = start_cluster(
        paced_model_dir,
        tmp_path_factory.mktemp("tcp"),
        worker_flags=["--max-model-len", "512"],
        layout="tcp",
        env={"FERRY_WIRE_KEYS": str(keys)},
    )
    yield c
    c.stop()


@pytest.fixture
def fresh_ipc(paced_model_dir, tmp_path_factory):
    """An ipc cluster of its own, for a test whose peer took the whole scheduler down before the fix."""
    c = start_cluster(paced_model_dir, tmp_path_factory.mktemp("ipc1"), worker_flags=["--max-model-len", "512"])
    yield c
    c.stop()


def _streams_all_complete(c, n: int = 8, tokens: int = 40, during=None) -> None:
    """n greedy streams of `tokens` tokens each finish whole while `during()` runs beside them."""
    results: list = []
    t = threading.Thread(
        target=lambda: results.append(
            stream_concurrently(c.base_url, [(f"stream {i} of the batch", tokens) for i in range(n)])
        )
    )
    t.start()
    try:
        if during is not None:
            time.sleep(0.3)
            during()
    finally:
        t.join(60)
    assert not t.is_alive(), "streams hung"
    assert results and [(usage, reason) for _, usage, reason in results[0]] == [(tokens, "length")] * n, results


# ---- 1. a stray ZeroMQ peer on the steps port ------------------------------------------------------


def test_1_a_stray_peer_on_the_steps_port_takes_no_step_and_wedges_nothing(tcp, keys):
    pub, sec = _load(keys, "worker")
    server = _load(keys, "scheduler")[0]
    rogues = [
        peer(zmq.PULL, tcp.steps_addr),
        peer(zmq.DEALER, tcp.steps_addr, b"rogue"),
        peer(zmq.DEALER, tcp.steps_addr, b"keyed-rogue", (pub, sec, server)),
    ]
    try:
        time.sleep(0.5)
        for i in range(3):  # one at a time: the PUSH of old spread steps over every PULL in turn
            client = openai.OpenAI(base_url=tcp.base_url + "/v1", api_key="x", max_retries=0, timeout=15)
            r = client.completions.create(model="tiny", prompt=f"wedge {i}", max_tokens=4)
            assert r.usage.completion_tokens == 4
        _streams_all_complete(tcp)
        assert http_get(tcp.base_url + "/health")[0] == 200
        assert all(not r.poll(0) for r in rogues), "a rogue peer received a step"
    finally:
        for r in rogues:
            r.close()


# ---- 2. one message kills the scheduler -----------------------------------------------------------


def test_2_malformed_messages_are_refused_and_the_scheduler_lives(fresh_ipc):
    ipc = fresh_ipc
    api = peer(zmq.DEALER, ipc.api_addr, b"rogue-api")
    sp = SamplingParams()
    try:
        send(api, Submit(req_id=101, prompt_token_ids=np.ones((2, 3), np.int32), sampling=sp))  # 2-D
        send(api, Submit(req_id=102, prompt_token_ids=np.array(["ab", "cd"]), sampling=sp))  # strings
        send(api, Submit(req_id=103, prompt_token_ids=np.array([np.nan, 1.0], np.float32), sampling=sp))  # NaN
        send(api, Submit(req_id=2**64 - 1, prompt_token_ids=np.array([1, 2], np.int32), sampling=sp))  # id past int64
        send(api, Submit(req_id=105, prompt_token_ids=np.array([2**40, 1], np.int64), sampling=sp))  # above int32
        send(
            api,
            Submit(
                req_id=106,
                prompt_token_ids=np.array([1, 2], np.int32),
                sampling=SamplingParams(temperature=float("nan")),
            ),
        )
        got = [m for m in replies(api, 3.0) if isinstance(m, Failed)]
        assert {m.req_id for m in got} == {101, 102, 103, 105, 106}, got
        assert all(m.error_type == "InvalidRequest" for m in got), got
    finally:
        api.close()
    results = peer(zmq.PUSH, ipc.results_addr)
    try:
        send(
            results,
            WorkerAlive(
                boot_id="huge",
                pool=PoolReport(
                    kv_pages=2**62,
                    page_size=16,
                    linear_state_slots=2**62,
                    max_running_requests=2**62,
                    max_prefill_tokens=2**62,
                    max_model_len=2**62,
                ),
            ),
        )
        time.sleep(0.5)
    finally:
        results.close()
    assert ipc.procs["scheduler"].poll() is None, ipc.log("scheduler")[-2000:]
    status, body = post(ipc.base_url, "/v1/completions", {"prompt": "still here", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3, body


# ---- 3. no authentication; one bad Submit failed its batch; a forged worker took over ------------


def test_3_one_bad_submit_fails_alone_not_its_batch(ipc):
    api = peer(zmq.DEALER, ipc.api_addr, b"rogue-oov")

    def bad_one():
        send(api, Submit(req_id=7, prompt_token_ids=np.array([1, 10**6, 2], np.int32), sampling=SamplingParams()))

    try:
        _streams_all_complete(ipc, during=bad_one)
        got = [m for m in replies(api, 1.0) if isinstance(m, Failed)]
        assert [(m.req_id, m.error_type) for m in got] == [(7, "InvalidRequest")] and "vocabulary" in got[0].message
    finally:
        api.close()


@pytest.mark.parametrize("layout", ["fresh_ipc", "tcp"])
def test_3_a_forged_worker_heartbeat_changes_nothing(layout, request, keys):
    c = request.getfixturevalue(layout)
    forger = peer(zmq.PUSH, c.results_addr)

    def forge():
        for i in range(8):
            send(forger, WorkerAlive(boot_id=f"forged-{i % 2}", pool=FORGED_POOL))
            time.sleep(0.1)

    try:
        _streams_all_complete(c, during=forge)
        _, body = http_get(f"http://127.0.0.1:{c.scheduler_health_port}/health")
        assert json.loads(body)["pool"]["kv_pages"] == 256
    finally:
        forger.close()


def test_3_a_peer_without_the_key_cannot_submit(tcp):
    rogue = peer(zmq.DEALER, tcp.api_addr, b"no-key")
    try:
        send(
            rogue,
            Submit(req_id=1, prompt_token_ids=np.array([5, 6, 7], np.int32), sampling=SamplingParams(), max_tokens=3),
        )
        got = replies(rogue, 2.0)
        assert got == [], f"heard the scheduler: {got}"
    finally:
        rogue.close()


# ---- 4. HTTP 500s --------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
HUGE = 2**70


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", HUGE),
        ("seed", HUGE),
        ("top_k", HUGE),
        ("stop_token_ids", [1, HUGE]),
        ("max_completion_tokens", HUGE),
        ("n", HUGE),
        ("top_logprobs", HUGE),
        ("logit_bias", {str(HUGE): 1}),
    ],
)
def test_4_integers_out_of_range_are_a_400_naming_the_field(ipc, field, value):
    status, payload = post(ipc.base_url, "/v1/chat/completions", {"messages": MSG, field: value, "logprobs": True})
    assert status == 400 and field in payload["error"]["message"], payload


@pytest.mark.parametrize(
    "field,value",
    [
        ("logprobs", HUGE),
        ("best_of", HUGE),
        ("n", HUGE),
        ("logprobs", 21),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {str(i): 1 for i in range(301)}),
    ],
)
def test_4_issue_11s_completion_fields_are_bounded(ipc, field, value):
    status, payload = post(ipc.base_url, "/v1/completions", {"prompt": "hi", field: value})
    assert status == 400 and field in payload["error"]["message"], payload


def test_4_out_of_range_integers_on_the_other_routes(ipc):
    status, payload = post(ipc.base_url, "/v1/completions", {"prompt": [1, HUGE]})
    assert status == 400, payload
    status, payload = post(ipc.base_url, "/v1/messages", {"model": "tiny", "messages": MSG, "max_tokens": HUGE})
    assert status == 400 and payload["type"] == "error" and "max_tokens" in payload["error"]["message"], payload


@pytest.mark.parametrize("where", ["ignored", "messages"])
def test_4_deep_nesting_is_a_400(ipc, where):
    deep = "[" * 1000 + "]" * 1000
    body = f'{{"messages": {json.dumps(MSG)}, "metadata": {deep}}}' if where == "ignored" else f'{{"messages": {deep}}}'
    status, payload = post(ipc.base_url, "/v1/chat/completions", body)
    assert status == 400 and "nests" in payload["error"]["message"], payload


# ---- 5. unbounded work before a cheap check -------------------------------------------------------


def test_5_a_huge_prompt_is_refused_before_tokenizing_and_delays_nobody(ipc):
    big = {"prompt": "word " * 780_000, "max_tokens": 1}  # 3.9 MB, under the 4 MiB body limit

    async def main():
        loop = asyncio.get_running_loop()
        bigs = [loop.run_in_executor(None, post, ipc.base_url, "/v1/completions", big) for _ in range(3)]
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        small = await loop.run_in_executor(
            None, post, ipc.base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}
        )
        small_s = time.monotonic() - t0
        return small, small_s, await asyncio.gather(*bigs)

    t0 = time.monotonic()
    small, small_s, bigs = asyncio.run(main())
    assert small[0] == 200 and small_s < 9.0, (small, small_s)
    assert all(s == 400 and "model length is 512" in p["error"]["message"] for s, p in bigs), bigs
    assert time.monotonic() - t0 < 24.0
    assert labelled_metric(ipc.base_url, "ferry_tokenizations_refused_total", reason="too_long") >= 3


# ---- 8. incomplete requests hold connections -------------------------------------------------------


def _held_open(port: int, data: bytes, seconds: float) -> tuple[bool, bytes]:
    """(still open after `seconds`, what the server sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as s:
        s.sendall(data)
        got = b""
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                s.settimeout(max(0.05, deadline - time.monotonic()))
                chunk = s.recv(65536)
                if not chunk:
                    return False, got
                got += chunk
        except TimeoutError:
            return True, got
        return True, got


def test_8_a_body_that_never_arrives_times_out(ipc):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    still_open, got = _held_open(ipc.port, head + b'{"prompt": "', 6.0)
    assert not still_open and b" 408 " in got.split(b"\r\n")[0], got[:200]
    assert b'"error"' in got


def test_8_headers_that_never_end_time_out(ipc):
    still_open, _ = _held_open(ipc.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 6.0)
    assert not still_open


def test_8_a_malformed_request_gets_an_openai_error_object(ipc):
    _, got = _held_open(ipc.port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: banana\r\n\r\n", 3.0)
    head, _, body = got.partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n")[0] and json.loads(body)["error"]["type"] == "invalid_request_error", got


# ---- 10. a taken port; paths in /health ------------------------------------------------------------


def test_10_a_taken_port_is_one_clear_line(ipc, paced_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            api_command(paced_model_dir, ipc.api_addr, port),
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"--port {port}" in done.stderr and "already in use" in done.stderr


def test_10_health_shows_peers_and_no_paths(ipc, paced_model_dir):
    for port in (ipc.port, ipc.scheduler_health_port, ipc.worker_health_port):
        status, body = http_get(f"http://127.0.0.1:{port}/health")
        assert status == 200 and str(paced_model_dir) not in body and "peers" in json.loads(body), body


# ---- 9. SIGTERM drains (last: it stops the module's ipc cluster's api) ----------------------------


def test_9_sigterm_drains_in_flight_requests_and_refuses_new_ones(ipc):
    client = openai.OpenAI(base_url=ipc.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    stream = client.completions.create(
        model="tiny", prompt="drain me", max_tokens=120, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    text = [next(chunks).choices[0].text]
    ipc.procs["api"].send_signal(signal.SIGTERM)
    time.sleep(0.3)
    req = urllib.request.Request(
        ipc.base_url + "/v1/completions",
        data=b'{"prompt": "late", "max_tokens": 2}',
        headers={"Content-Type": "application/json"},
    )
    try:
        urllib.request.urlopen(req, timeout=5)
        raise AssertionError("a new request was admitted while draining")
    except urllib.error.HTTPError as e:
        assert e.code == 503 and e.headers["Retry-After"], e
    reasons = []
    for chunk in chunks:
        text.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "length" and len(text) >= 100
    assert ipc.procs["api"].wait(timeout=10) == 0
