"""`ferry serve` starts the three processes on private ipc sockets and stops them all on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import openai

from tests.integration.harness import FAKE_BOOT, REPO, child_env, eventually, free_port, healthy


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purposes
        return f.read().split(") ")[1][0] != "Z"


def test_serve_runs_three_torch_free_control_processes_and_stops_them_on_sigterm(model_dir, short_tmp_path):
    port = free_port()
    env = child_env()
    env["TMPDIR"] = str(short_tmp_path)
    log = open(short_tmp_path / "serve.log", "w")
    serve = subprocess.Popen(
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
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        assert eventually(lambda: healthy(url), timeout=60), (short_tmp_path / "serve.log").read_text()[-3000:]
        r = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
            model="tiny", prompt="hello", max_tokens=4
        )
        assert r.usage.completion_tokens == 4
        kids = children_of(serve.pid)
        assert len(kids) == 3
        # sockets live in a private directory
        rundirs = [p for p in short_tmp_path.iterdir() if p.name.startswith("ferry-")]
        assert len(rundirs) == 1 and (rundirs[0].stat().st_mode & 0o077) == 0
        assert {p.name for p in rundirs[0].iterdir()} == {"api.sock", "steps.sock", "results.sock"}
        # control-plane processes never load torch
        commands = {pid: open(f"/proc/{pid}/cmdline").read().split("\0") for pid in kids}
        for pid, cmd in commands.items():
            if "api" in cmd or "scheduler" in cmd:
                assert "libtorch" not in open(f"/proc/{pid}/maps").read(), cmd
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=15) == 0
        assert not any(alive(pid) for pid in kids)
        assert not rundirs[0].exists()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_serve_stops_everything_and_fails_when_one_process_dies(model_dir, short_tmp_path):
    port = free_port()
    env = child_env()
    env["TMPDIR"] = str(short_tmp_path)
    serve = subprocess.Popen(
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
            "--max-model-len",
            "256",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert eventually(lambda: healthy(f"http://127.0.0.1:{port}"), timeout=60)
        kids = children_of(serve.pid)
        worker = next(pid for pid in kids if "worker" in open(f"/proc/{pid}/cmdline").read().split("\0"))
        os.kill(worker, signal.SIGKILL)
        assert serve.wait(timeout=15) == 1
        assert not any(alive(pid) for pid in kids)
        events = [json.loads(line) for line in serve.stderr.read().splitlines() if line.startswith("{")]
        assert any(e["event"] == "process_exited" and e["child"] == "worker" for e in events)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
