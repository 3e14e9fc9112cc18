"""Issue 22, 2: a request the server could not finish ends in an error its client sees, never in a
normal-looking stop. The scheduler fails (not "finishes") the requests of an api replica it declared
lost; and a real api that hears of an abort it did not ask for ends the request with an error: an error
event on a stream (OpenAI: a final `data: {"error": ...}` and no [DONE]; Anthropic: `event: error`), a
5xx otherwise, counted as outcome="failed". Loopback and ipc only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import zmq

from ferry.shared.messages import (
    ApiHeartbeat,
    ApiToScheduler,
    Failed,
    Finished,
    SchedulerStatus,
    Submit,
    Tokens,
)
from ferry.shared.sampling import SamplingParams
from ferry.shared.wire import Codec
from tests.integration.harness import (
    REPO,
    api_command,
    ascii_word_tokens,
    child_env,
    eventually,
    free_port,
    healthy,
    http_get,
    labelled_metric,
    start_cluster,
)
from tests.integration.wire_peers import peer, replies, send


def test_the_scheduler_fails_the_requests_of_a_replica_it_declared_lost(slow_model_dir, tmp_path):
    """A replica that submits and then goes silent is declared lost: its request ends as a Failed
    (ServiceUnavailable) should the replica still listen, never as a Finished."""
    c = start_cluster(slow_model_dir, tmp_path / "run", worker_flags=["--max-model-len", "512"])
    ghost = peer(zmq.DEALER, c.api_addr, b"ghost-replica")
    try:
        send(
            ghost,
            Submit(req_id=7, prompt_token_ids=np.array([3, 4, 5], np.int32), sampling=SamplingParams(), max_tokens=400),
        )  # 20 ms steps: 8 s of work
        got = replies(ghost, 6.0)  # silent all along: lost after 2.5 s
        ends = [m for m in got if isinstance(m, (Finished, Failed))]
        tokens = sum(len(m.token_ids) for m in got if isinstance(m, Tokens))
        assert len(ends) == 1 and isinstance(ends[0], Failed), ends
        assert ends[0].req_id == 7 and ends[0].error_type == "ServiceUnavailable", ends[0]
        assert "api replica" in ends[0].message and 0 < tokens < 400, (ends[0].message, tokens)
        assert "api_replica_lost" in c.log("scheduler")
    finally:
        ghost.close()
        c.stop()


class _AbortingScheduler(threading.Thread):
    """A stand-in scheduler on an ipc ROUTER: ready in its status, it answers every Submit with three
    tokens and then a Finished "abort" the api never asked for (what the scheduler of old sent for the
    requests of a replica it declared lost)."""

    def __init__(self, addr: str, token_ids: list[int]):
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.codec = Codec(ApiToScheduler)
        self.token_ids = token_ids
        self.replicas: set[bytes] = set()
        self.stopped = threading.Event()

    def _send(self, to: bytes, msg) -> None:
        try:
            self.sock.send_multipart([to, *self.codec.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def run(self) -> None:
        next_status = 0.0
        while not self.stopped.is_set():
            if time.monotonic() >= next_status:
                for r in self.replicas:
                    self._send(r, SchedulerStatus(boot_id="stand-in", ready=True, reason="", max_model_len=512))
                next_status = time.monotonic() + 0.3
            if not self.sock.poll(50):
                continue
            client, *frames = self.sock.recv_multipart()
            msg = self.codec.decode(frames)
            if isinstance(msg, ApiHeartbeat):
                self.replicas.add(msg.replica.encode() if getattr(msg, "replica", "") else client)
            elif isinstance(msg, Submit):
                self.replicas.add(client)
                for t in self.token_ids:
                    self._send(client, Tokens(np.array([msg.req_id], np.int64), np.array([t], np.int32)))
                self._send(
                    client,
                    Finished(
                        req_id=msg.req_id,
                        reason="abort",
                        prompt_tokens=len(msg.prompt_token_ids),
                        completion_tokens=len(self.token_ids),
                    ),
                )
        self.sock.close()


@pytest.fixture
def api_beside_an_aborting_scheduler(model_dir, tiny_tokenizer, tmp_path):
    sock_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ferry-abort-{os.getpid()}-{free_port()}"
    sock_dir.mkdir(mode=0o700)  # ipc paths must stay short
    addr = f"ipc://{sock_dir}/api.sock"
    scheduler = _AbortingScheduler(addr, ascii_word_tokens(tiny_tokenizer)[:3])
    scheduler.start()
    port = free_port()
    log = open(tmp_path / "api.log", "w")
    api = subprocess.Popen(
        api_command(model_dir, addr, port), cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert eventually(lambda: healthy(url), timeout=60), (tmp_path / "api.log").read_text()[-3000:]
        yield url
    finally:
        api.terminate()
        api.wait(timeout=20)
        scheduler.stopped.set()
        scheduler.join(5)
        shutil.rmtree(sock_dir, ignore_errors=True)


def _post(url: str, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _data(sse: str) -> list[str]:
    return [line[len("data: ") :] for line in sse.splitlines() if line.startswith("data: ")]


def test_an_abort_the_client_did_not_ask_for_ends_in_an_error_it_sees(api_beside_an_aborting_scheduler):
    url = api_beside_an_aborting_scheduler
    for path, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 50, "stream": True}),
        (
            "/v1/chat/completions",
            {"model": "tiny", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "hello"}]},
        ),
    ):
        status, text = _post(url, path, body)
        data = _data(text)
        assert status == 200 and data, (path, status, text[:300])  # headers went out with the first token
        assert "[DONE]" not in data, data  # the stream does not end as a complete one
        last = json.loads(data[-1])
        assert set(last) == {"error"} and last["error"]["code"] == 503 and "aborted" in last["error"]["message"], last
        reasons = [c["finish_reason"] for d in data[:-1] for c in json.loads(d).get("choices", [])]
        assert not any(reasons), (path, reasons)  # no choice looks finished: no "abort", no "stop"

    status, text = _post(
        url,
        "/v1/messages",
        {"model": "tiny", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "hello"}]},
    )
    events = [line[len("event: ") :] for line in text.splitlines() if line.startswith("event: ")]
    assert status == 200 and events[-1] == "error", events
    error = json.loads(_data(text)[-1])
    assert error["type"] == "error" and error["error"]["type"] in ("overloaded_error", "api_error"), error
    assert "message_delta" not in events and "message_stop" not in events, events  # no stop_reason: end_turn

    status, text = _post(url, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 50})
    assert status == 503 and "aborted" in json.loads(text)["error"]["message"], (status, text)
    status, text = _post(
        url, "/v1/messages", {"model": "tiny", "max_tokens": 50, "messages": [{"role": "user", "content": "hello"}]}
    )
    assert status == 503 and json.loads(text)["error"]["type"] == "overloaded_error", (status, text)

    for route in ("completions", "chat", "messages"):
        assert labelled_metric(url, "ferry_requests_total", route=route, outcome="failed") >= 1, route
    assert 'outcome="abort"' not in http_get(url + "/metrics")[1]
