"""Issue 57, 7: requests still running when an api's --drain-timeout passes end in an error: a stream in
an error event and a well-formed end of its body (not a cut chunked transfer), an unstreamed request in
a 503. Each is counted failed and aborted at the scheduler, which stops generating for it. Against the
real api, scheduler and worker processes around the PagedHashModel double (steps of 20 ms: 1,500
tokens take half a minute)."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

from tests.integration.harness import eventually, metric, start_cluster

DRAIN_TIMEOUT_S = 2.0


def _stream(port: int, path: str, body: dict, started: threading.Event, out: dict) -> None:
    """POST a streamed request and read its whole body; out: status, body, or the error that cut it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            path,
            json.dumps(body),
            {"Content-Type": "application/json", "x-api-key": "x", "anthropic-version": "2023-06-01"},
        )
        if not body.get("stream"):
            started.set()  # its answer comes at the end
        response = conn.getresponse()
        out["status"] = response.status
        first = response.read1(65536)  # (chunked: returns what one chunk brought)
        started.set()
        out["body"] = first + response.read()  # raises IncompleteRead on a cut chunked body
    except Exception as exc:  # noqa: BLE001 - handed to the test
        out["error"] = repr(exc)
    finally:
        started.set()
        conn.close()


def _events(body: bytes) -> list[tuple[str | None, str]]:
    """[(event name or None, data)] of an SSE body."""
    events = []
    for block in body.decode().split("\n\n"):
        name = data = None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
        if data is not None:
            events.append((name, data))
    return events


def test_streams_running_at_the_drain_timeout_end_in_an_error_and_are_aborted(slow_model_dir, tmp_path):
    c = start_cluster(
        slow_model_dir,
        tmp_path / "run",
        worker_flags=["--max-model-len", "2048"],
        api_flags=["--drain-timeout", str(DRAIN_TIMEOUT_S)],
    )
    try:
        scheduler_url = f"http://127.0.0.1:{c.scheduler_health_port}"
        jobs = {
            "openai": (
                "/v1/completions",
                {"prompt": "drain me", "max_tokens": 1500, "stream": True, "ignore_eos": True},
            ),
            "anthropic": (
                "/v1/messages",
                {
                    "model": "tiny",
                    "max_tokens": 1500,
                    "stream": True,
                    "messages": [{"role": "user", "content": "drain me too"}],
                },
            ),
            "plain": ("/v1/completions", {"prompt": "drain me, unstreamed", "max_tokens": 1500, "ignore_eos": True}),
        }
        outs = {name: {} for name in jobs}
        started = {name: threading.Event() for name in jobs}
        threads = [
            threading.Thread(target=_stream, args=(c.port, path, body, started[name], outs[name]))
            for name, (path, body) in jobs.items()
        ]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started.values()), outs
        assert eventually(lambda: metric(scheduler_url, "ferry_scheduler_running_requests") == 3, timeout=10)
        c.procs["api"].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        for t in threads:
            t.join(30)
        ended = time.monotonic() - sent

        for name, out in outs.items():
            assert "error" not in out and "body" in out, (name, out)  # a whole body (a cut chunked one raises)
        assert ended < DRAIN_TIMEOUT_S + 5, ended
        assert outs["openai"]["status"] == outs["anthropic"]["status"] == 200
        name, data = _events(outs["openai"]["body"])[-1]
        error = json.loads(data)["error"]
        assert name is None and error["code"] == 503 and "drain timeout" in error["message"], data
        name, data = _events(outs["anthropic"]["body"])[-1]
        assert name == "error" and json.loads(data)["error"]["type"] == "overloaded_error", (name, data)
        assert "drain timeout" in json.loads(data)["error"]["message"]
        plain = json.loads(outs["plain"]["body"])
        assert outs["plain"]["status"] == 503 and "drain timeout" in plain["error"]["message"], plain

        # the scheduler stopped generating for both at once (not when it found the replica gone, 2.5 s
        # after it exited: by then it would count them among the lost replica's requests)
        assert eventually(lambda: metric(scheduler_url, "ferry_scheduler_running_requests") == 0, timeout=2)
        assert c.procs["api"].wait(timeout=15) == 0
        lost = eventually(
            lambda: [json.loads(line) for line in c.log("scheduler").splitlines() if '"api_replica_lost"' in line],
            timeout=15,
        )
        assert lost and all(e["aborted"] == 0 for e in lost), lost
        api_events = [json.loads(line) for line in c.log("api").splitlines() if line.startswith("{")]
        stopped = [e for e in api_events if e["event"] == "request_aborted"]
        assert sorted(e["route"] for e in stopped) == ["completions", "completions", "messages"], stopped
        assert all(e["outcome"] == "failed" and e["error"] == "DrainTimedOut" for e in stopped), stopped
        assert [e["in_flight"] for e in api_events if e["event"] == "api_drain_timed_out"] == [3]
    finally:
        c.stop()
