"""Issue 22's reproduced problems, one test each (numbered as in the issue), against the real api,
scheduler and worker processes around the PagedHashModel double: a body of any shape is answered at
once while /health keeps answering, no request is a 500 it should not be, errors name their field, any
case of the Bearer scheme works, every refusal is counted as a request, what clients read names no
socket path, and a large schema holds up no other request. In process: tests/unit/test_api_http_edge.py."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.harness import (
    REPO,
    api_command,
    child_env,
    eventually,
    free_port,
    http_get,
    labelled_metric,
    start_cluster,
)
from tests.unit.test_api_http_edge import adversarial_bodies

KEY = "edge-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def edge(slow_model_dir, tmp_path_factory):
    """Steps take 20 ms; the api wants a key (the Bearer case); the ipc layout of `ferry serve`."""
    c = start_cluster(
        slow_model_dir,
        tmp_path_factory.mktemp("edge"),
        worker_flags=["--max-model-len", "512"],
        api_flags=["--api-key", KEY],
    )
    yield c
    c.stop()


def post(base_url: str, path: str, body: bytes | dict, headers: dict | None = None, timeout: float = 10):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        base_url + path,
        data=data,
        method="POST",
        headers={"Content-Type": "application/json", **AUTH, **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _log_events(c, since: int = 0) -> list[dict]:
    return [json.loads(line) for line in c.log("api").splitlines()[since:] if line.startswith("{")]


# ---- 1. a body of any shape, answered at once; /health answers meanwhile ------------------------------


def test_1_adversarial_4mib_bodies_are_answered_within_a_second_while_health_answers(edge):
    stop, health = threading.Event(), []

    def poll():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ok = http_get(edge.base_url + "/health", timeout=5)[0] == 200
            except OSError:
                ok = False
            health.append((ok, time.monotonic() - t0))
            time.sleep(0.05)

    poller = threading.Thread(target=poll)
    poller.start()
    answered = {}
    try:
        for shape, body in adversarial_bodies().items():
            t0 = time.monotonic()
            try:
                status, payload = post(edge.base_url, "/v1/chat/completions", body, timeout=10)
            except OSError as exc:  # the quadratic scan of old: still scanning when the client gave up
                status, payload = None, str(exc)
            answered[shape] = (status, round(time.monotonic() - t0, 3), str(payload)[:120])
    finally:
        stop.set()
        poller.join(10)
    assert all(status == 400 and took < 3.0 for status, took, _ in answered.values()), (
        answered
    )  # the scan of old: 18 s+
    assert health and all(ok and took < 1.5 for ok, took in health), max(took for _, took in health)


# ---- 4. 500s that were the client's doing --------------------------------------------------------------


@pytest.mark.parametrize("key", ["tools", "messages"])
def test_4_a_reserved_chat_template_kwarg_is_a_400_naming_it(edge, key):
    status, payload = post(edge.base_url, "/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {key: 5}})
    assert status == 400 and payload["error"]["param"] == f"chat_template_kwargs.{key}", payload
    assert f"chat_template_kwargs.{key}" in payload["error"]["message"]
    status, payload = post(edge.base_url, "/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": 5})
    assert status == 400 and payload["error"]["param"] == "chat_template_kwargs", payload


def test_4_a_client_that_closes_mid_body_is_a_disconnect_not_a_500(edge):
    def counts():
        return (
            labelled_metric(edge.base_url, "ferry_refused_requests_total", route="/v1/chat/completions", status="500"),
            labelled_metric(edge.base_url, "ferry_requests_total", route="chat", outcome="disconnected"),
        )

    lines = len(edge.log("api").splitlines())
    errors, left = counts()
    with socket.create_connection(("127.0.0.1", edge.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 1000\r\n\r\n{"messages":'
        )
        time.sleep(0.3)
    assert eventually(lambda: counts()[1] == left + 1), counts()
    assert counts()[0] == errors
    events = _log_events(edge, lines)
    assert not [e for e in events if e["event"] == "unhandled_error" or e["level"] == "error"], events
    assert [e["level"] for e in events if e["event"] == "client_disconnected"] == ["info"], events


# ---- 7. the smaller ones --------------------------------------------------------------------------------


def test_7_a_lowercase_bearer_scheme_is_accepted(edge):
    status, payload = post(
        edge.base_url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers={"Authorization": f"bearer {KEY}"}
    )
    assert status == 200 and payload["usage"]["completion_tokens"] == 2, payload
    status, _ = post(edge.base_url, "/v1/completions", {"prompt": "hi"}, headers={"Authorization": "bearer wrong"})
    assert status == 401


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": MSG, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"messages": [*MSG, *MSG, {"role": "user", "content": ""}]}, "messages[2].content"),
        ("/v1/chat/completions", {"messages": MSG, "n": 17}, "n"),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2**70}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"-1": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "xml"}}, "response_format.type"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": "hello " * 2000}, "prompt"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "hi"}, "model"),
    ],
)
def test_7_an_error_about_one_field_names_it_in_param(edge, path, body, param):
    status, payload = post(edge.base_url, path, body)
    assert 400 <= status < 500 and payload["error"]["param"] == param, payload


def test_7_every_refused_request_is_counted_in_ferry_requests_total(edge):
    def totals() -> tuple[float, float]:
        _, text = http_get(edge.base_url + "/metrics")
        requests = refused = 0.0
        for line in text.splitlines():
            if line.startswith("ferry_requests_total{") and 'outcome="refused"' in line:
                requests += float(line.rsplit(" ", 1)[1])
            if line.startswith("ferry_refused_requests_total{") and 'route="/health"' not in line:
                refused += float(line.rsplit(" ", 1)[1])
        return requests, refused

    before = totals()
    post(edge.base_url, "/v1/chat/completions", b"{not json")  # 400 before the scheduler
    post(edge.base_url, "/v1/chat/completions", {"messages": MSG, "top_p": 0})  # 400 from validation
    post(edge.base_url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 100000})  # 400 from the scheduler
    post(edge.base_url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})  # 404
    post(edge.base_url, "/v1/completions", {"prompt": "hi"}, headers={"Authorization": ""})  # 401
    post(edge.base_url, "/v1/completions", {"prompt": "x" * (5 * 2**20)})  # 413
    http_get(edge.base_url + "/v1/models/gpt-9")  # 401 (no key)
    after = totals()
    assert (after[0] - before[0], after[1] - before[1]) == (7, 7), (before, after)


def test_7_no_socket_path_reaches_a_client(slow_model_dir, tmp_path):
    """An api whose scheduler is not there: its /health and its 503s say "the scheduler", not where."""
    addr = f"ipc://{tmp_path}/api.sock"
    port = free_port()
    log = open(tmp_path / "api.log", "w")
    proc = subprocess.Popen(
        api_command(slow_model_dir, addr, port), cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT
    )
    try:

        def answered():
            try:
                return http_get(f"http://127.0.0.1:{port}/health")
            except OSError:
                return None

        health = eventually(answered, timeout=60, interval=0.2)
        assert health is not None, (tmp_path / "api.log").read_text()[-2000:]
        status, payload = post(f"http://127.0.0.1:{port}", "/v1/completions", {"prompt": "hi"})
        assert health[0] == 503 and status == 503 and "the scheduler" in payload["error"]["message"], (health, payload)
        for text in (health[1], json.dumps(payload)):
            assert str(tmp_path) not in text and "ipc://" not in text, text
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_7_large_schemas_hold_up_no_other_request(edge):
    """A 6,000-property schema takes its grammar a quarter of a second or more to build. Three of them
    (bodies under 256 KiB: the short lane's of old), each with n=16 choices sharing one grammar, build on
    the grammar lane; a small request sent meanwhile waits for none of them."""
    props = {f"p{i}": {"type": "string"} for i in range(6000)}
    heavy = {
        "messages": MSG,
        "n": 16,
        "max_tokens": 2,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": props, "required": list(props)}},
        },
    }
    assert len(json.dumps(heavy)) < 256 * 1024
    small = {"messages": MSG, "max_tokens": 1}
    done: dict[str, tuple[int, float]] = {}

    def timed(name: str, body: dict) -> None:
        t0 = time.monotonic()
        status, _ = post(edge.base_url, "/v1/chat/completions", body, timeout=30)
        done[name] = (status, time.monotonic() - t0)

    post(edge.base_url, "/v1/chat/completions", small)  # warm: the first request pays for imports
    heavies = [threading.Thread(target=timed, args=(f"heavy{i}", heavy)) for i in range(3)]
    for t in heavies:
        t.start()
    time.sleep(0.15)
    timed("small", small)
    for t in heavies:
        t.join(30)
    assert all(status == 200 for status, _ in done.values()) and len(done) == 4, done
    fastest_heavy = min(took for name, (_, took) in done.items() if name != "small")
    assert done["small"][1] < fastest_heavy / 2, done
