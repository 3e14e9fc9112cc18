"""Supervision: processes restarted as compose's restart policy would are rejoined without a manual
step; `ferry serve`'s children die with it and its leftovers go at the next start; a step that is
never answered fails its requests whatever the worker's heartbeat says. Loopback and ipc only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import zmq
import zmq.auth

from ferry.shared.messages import ApiHeartbeat, Failed, PoolReport, Submit, WorkerAlive
from ferry.shared.sampling import SamplingParams
from tests.integration.harness import (
    FAKE_BOOT,
    REPO,
    child_env,
    eventually,
    free_port,
    health_turns_503,
    http_get,
    labelled_metric,
    start_cluster,
)
from tests.integration.test_serve_command import alive, children_of
from tests.integration.wire_peers import peer, replies, send

WAIT_S = 120  # the most a step of these tests waits for the cluster: seconds on an idle machine, more when loaded


def _complete(base_url: str, prompt: str, n: int = 4) -> int:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=20)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=n).usage.completion_tokens


@pytest.mark.slow
def test_killed_services_restarted_as_compose_would_serve_again_in_the_tcp_layout(model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    for role in ("scheduler", "api", "worker"):
        zmq.auth.create_certificates(str(keys), role)
    c = start_cluster(
        model_dir,
        tmp_path / "run",
        worker_flags=["--max-model-len", "512"],
        layout="tcp",
        env={"FERRY_WIRE_KEYS": str(keys)},
    )
    try:
        assert _complete(c.base_url, "before") == 4
        # the worker dies; compose starts it again with the same command and environment
        c.procs["worker"].send_signal(signal.SIGKILL)
        c.procs["worker"].wait()
        health_turns_503(c.base_url, "worker")
        refused_before = labelled_metric(c.base_url, "ferry_requests_total", route="completions", outcome="refused")
        left_before = labelled_metric(c.base_url, "ferry_requests_total", route="completions", outcome="disconnected")
        try:
            _complete(c.base_url, "while it is down")
            raise AssertionError("served without a worker")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and "worker" in exc.message and "scheduler" not in exc.message, exc.message
        c.restart("worker")
        assert eventually(lambda: http_get(c.base_url + "/health")[0] == 200, timeout=30), c.log("scheduler")[-2000:]
        assert _complete(c.base_url, "after the worker came back") == 4
        # 9. outcomes by what happened: the 503 is a refusal, nobody disconnected
        assert (
            labelled_metric(c.base_url, "ferry_requests_total", route="completions", outcome="disconnected")
            == left_before
        )
        assert (
            labelled_metric(c.base_url, "ferry_requests_total", route="completions", outcome="refused")
            == refused_before + 1
        )
        # the scheduler dies and comes back: the api and the worker reconnect on their own
        c.procs["scheduler"].send_signal(signal.SIGKILL)
        c.procs["scheduler"].wait()
        health_turns_503(c.base_url, "scheduler")
        c.restart("scheduler")
        assert eventually(lambda: http_get(c.base_url + "/health")[0] == 200, timeout=30), c.log("scheduler")[-2000:]
        assert _complete(c.base_url, "after the scheduler came back") == 4
        _, body = http_get(f"http://127.0.0.1:{c.worker_health_port}/health")
        assert json.loads(body)["peers"]["scheduler"] == "ready", body
    finally:
        c.stop()


def test_a_step_never_answered_fails_its_request_though_the_worker_says_idle(model_dir, tmp_path):
    """A worker that heartbeats "idle" and never answers (its step lost, or taken by another peer): the
    request fails within a few seconds, by the scheduler's own clock, and the worker is kept."""
    c = start_cluster(model_dir, tmp_path, wait=False)
    for name in ("api", "worker"):
        c.procs[name].kill()
        c.procs[name].wait()
    boot = "mute-worker"
    steps = peer(zmq.DEALER, c.steps_addr, boot.encode())
    beats = peer(zmq.PUSH, c.results_addr)
    api = peer(zmq.DEALER, c.api_addr, b"probe")
    pool = PoolReport(
        kv_pages=64,
        page_size=16,
        linear_state_slots=0,
        max_running_requests=8,
        max_prefill_tokens=512,
        max_model_len=256,
    )

    def beat() -> None:
        send(beats, WorkerAlive(boot_id=boot, pool=pool))  # idle, and never received a step
        send(api, ApiHeartbeat())

    try:
        # bounds generous for a loaded machine: the scheduler adopts the mute worker once its heartbeats arrive
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not _ready(c.scheduler_health_port):
            beat()
            time.sleep(0.3)
        assert _ready(c.scheduler_health_port), c.log("scheduler")[-2000:]
        send(
            api,
            Submit(req_id=1, prompt_token_ids=np.array([3, 4, 5], np.int32), sampling=SamplingParams(), max_tokens=4),
        )
        sent_at, failed = time.monotonic(), []
        while time.monotonic() < sent_at + WAIT_S and not failed:
            beat()
            failed = [m for m in replies(api, 0.4) if isinstance(m, Failed)]
        # failed by the scheduler's step deadline ("never received"), not for want of a worker
        assert failed and failed[0].req_id == 1 and "never received" in failed[0].message, failed
        assert steps.poll(0), "the step went elsewhere than to the adopted worker"
        status, body = http_get(f"http://127.0.0.1:{c.scheduler_health_port}/health")
        assert status == 200, body  # the worker itself is still adopted
    finally:
        for s in (steps, beats, api):
            s.close()
        c.stop()


def _serve(model_dir, short_tmp_path, port: int, log_name: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**child_env(), "TMPDIR": str(short_tmp_path), **(env_extra or {})}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ferry.services.cli",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--boot",
            FAKE_BOOT,
            "--served-model-name",
            "tiny",
            "--max-model-len",
            "256",
        ],
        cwd=REPO,
        env=env,
        stdout=open(short_tmp_path / log_name, "w"),
        stderr=subprocess.STDOUT,
    )


def _ready(port: int) -> bool:
    try:
        return http_get(f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200
    except OSError:
        return False


def test_kill_9_of_serve_takes_its_children_and_the_next_start_clears_the_leftovers(model_dir, short_tmp_path):
    secret = "sk-never-on-a-command-line"
    port = free_port()
    serve = _serve(model_dir, short_tmp_path, port, "serve1.log", {"FERRY_API_KEY": secret})
    second = None
    try:
        assert eventually(lambda: _ready(port), timeout=60), (short_tmp_path / "serve1.log").read_text()[-3000:]
        kids = children_of(serve.pid)
        assert len(kids) == 3
        # 7. the key reaches the api in a file of the private run directory: no child's command line
        # nor environment (`ps e`) holds it, and the api does want it
        for pid in kids:
            assert secret not in Path(f"/proc/{pid}/cmdline").read_text(), pid
            assert secret not in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace"), pid
        assert http_get(f"http://127.0.0.1:{port}/v1/models")[0] == 401
        rundirs = [p for p in short_tmp_path.iterdir() if p.name.startswith("ferry-")]
        assert len(rundirs) == 1
        # 6. kill -9 of serve: its children follow it
        serve.send_signal(signal.SIGKILL)
        serve.wait()
        assert eventually(lambda: not any(alive(pid) for pid in kids), timeout=30), [p for p in kids if alive(p)]
        assert rundirs[0].exists()  # nothing ran serve's cleanup
        port2 = free_port()
        second = _serve(model_dir, short_tmp_path, port2, "serve2.log")
        assert eventually(lambda: _ready(port2), timeout=60), (short_tmp_path / "serve2.log").read_text()[-3000:]
        assert not rundirs[0].exists(), "the killed serve's socket directory is still there"
        assert len([p for p in short_tmp_path.iterdir() if p.name.startswith("ferry-")]) == 1
    finally:
        for p in (serve, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0]


def test_kill_9_of_serve_takes_a_stopped_child_too(model_dir, short_tmp_path):
    """Issue 22, 6: `kill -STOP <worker>; kill -9 <serve>` left the worker in state T under PID 1: a
    stopped process does not act on SIGTERM (serve's death signal of old). SIGKILL ends it, stopped or not."""
    port = free_port()
    serve = _serve(model_dir, short_tmp_path, port, "serve.log")
    kids: list[int] = []
    try:
        assert eventually(lambda: _ready(port), timeout=60), (short_tmp_path / "serve.log").read_text()[-3000:]
        kids = children_of(serve.pid)
        worker = next(pid for pid in kids if "worker" in open(f"/proc/{pid}/cmdline").read().split("\0"))
        os.kill(worker, signal.SIGSTOP)
        assert eventually(lambda: _state(worker) == "T", timeout=15)
        serve.send_signal(signal.SIGKILL)
        serve.wait()
        assert eventually(lambda: not any(alive(pid) for pid in kids), timeout=30), {
            pid: _state(pid) for pid in kids if alive(pid)
        }
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        for pid in kids:  # what the old death signal left behind: this test's own processes
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_serve_a_dead_worker_is_named_to_the_requests_it_took(slow_model_dir, short_tmp_path):
    """9. the worker dies under serve: a stream in flight ends with an error naming the worker (the api
    drains while the others stop), not a cut connection blamed on the scheduler."""
    port = free_port()
    serve = _serve(slow_model_dir, short_tmp_path, port, "serve.log")
    try:
        assert eventually(lambda: _ready(port), timeout=60), (short_tmp_path / "serve.log").read_text()[-3000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.completions.create(model="tiny", prompt="doomed", max_tokens=200, stream=True)
        chunks = iter(stream)
        next(chunks)
        worker = next(
            pid for pid in children_of(serve.pid) if "worker" in open(f"/proc/{pid}/cmdline").read().split("\0")
        )
        os.kill(worker, signal.SIGKILL)
        try:
            for _ in chunks:
                pass
            raise AssertionError("the stream finished although its worker died")
        except openai.APIError as exc:
            assert "worker" in str(exc) and "scheduler" not in str(exc), str(exc)
        assert serve.wait(timeout=30) == 1
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
