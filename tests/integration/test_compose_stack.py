"""compose.yaml run for real on a Docker engine: the three services without a GPU (compose.cpu.yaml) and
the demo, each serving a stream that `docker compose stop` lets finish, and a worker that cannot read its
model. The files are written here as this user, the way the README says (`ferry keys`,
`ferry make-tiny-model`), and read in the containers by uid 10001.

Skipped where `docker` reaches no engine (CI), and where the image is not built: build it first with
`TORCH_INDEX=https://download.pytorch.org/whl/cpu docker compose build` (minutes; not the suite's job).
FERRY_TEST_COMPOSE_FILES adds compose files after compose.yaml (colon-separated; a host's own override,
e.g. one that drops what its daemon cannot do)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.integration.harness import free_port

REPO = Path(__file__).resolve().parents[2]
IMAGE = "ferry:0.1.0"
UP_TIMEOUT_S = 1200  # a vfs-backed engine copies the image per container (about 30 s each)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _docker_ready() -> str | None:
    """Why compose cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker client"
    try:
        info = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "the docker engine does not answer"
    if info.returncode != 0:
        return f"no reachable docker engine ({info.stderr.strip()[:200]})"
    version = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True, timeout=30)
    if version.returncode != 0 or not version.stdout.strip().lstrip("v").startswith("2"):
        return "no Compose v2 (`docker compose`)"
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=30).returncode != 0:
        return f"{IMAGE} is not built: TORCH_INDEX=https://download.pytorch.org/whl/cpu docker compose build"
    return None


@pytest.fixture(scope="module")
def docker():
    reason = _docker_ready()
    if reason:
        pytest.skip(reason)


class Stack:
    """One compose project of this checkout's files, its model and keys in a temporary directory, its
    published ports free ones; `down -v` at the end."""

    def __init__(self, tmp: Path, files: list[str], model: Path):
        self.name = f"ferry-test-{uuid.uuid4().hex[:8]}"
        self.api_port, self.demo_port = free_port(), free_port()
        ports = tmp / "ports.yaml"
        ports.write_text(
            "services:\n"
            f"  api:\n    ports: !override ['127.0.0.1:{self.api_port}:8000']\n"
            f"  demo:\n    ports: !override ['127.0.0.1:{self.demo_port}:8000']\n"
        )
        extra = [f for f in os.environ.get("FERRY_TEST_COMPOSE_FILES", "").split(":") if f]
        self.files = [str(REPO / "compose.yaml"), *files, *extra, str(ports)]
        keys = tmp / "keys"
        keys.mkdir()
        done = subprocess.run(
            [sys.executable, "-m", "ferry.services.cli", "keys", str(keys)],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=_env(),
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        # compose.yaml says `sudo chown -R 10001 keys`; a test without root makes them readable instead
        for f in keys.iterdir():
            f.chmod(0o644)
        self.env = {**os.environ, "FERRY_MODEL_DIR": str(model), "FERRY_KEYS_DIR": str(keys), "FERRY_API_KEY": ""}

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["docker", "compose", "-p", self.name, *[a for f in self.files for a in ("-f", f)], *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self.env, cwd=REPO)
        if check:
            assert done.returncode == 0, (cmd, done.stdout[-3000:], done.stderr[-3000:])
        return done

    def inspect(self, service: str) -> dict:
        ids = self.compose("ps", "-a", "-q", service).stdout.split()
        assert len(ids) == 1, ids
        done = subprocess.run(["docker", "inspect", ids[0]], capture_output=True, text=True, timeout=60, check=True)
        return json.loads(done.stdout)[0]

    def down(self) -> None:
        self.compose("--profile", "cpu", "down", "-v", "-t", "5", timeout=600, check=False)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """`ferry make-tiny-model DIR` as this user, as the README says: its files must be readable in the containers."""
    out = tmp_path_factory.mktemp("compose-model") / "model"
    done = subprocess.run(
        [sys.executable, "-m", "ferry.services.cli", "make-tiny-model", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return out


def chat_request(port: int, max_tokens: int, stream: bool) -> urllib.request.Request:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        model = json.load(resp)["data"][0]["id"]
    body = json.dumps(
        {
            "model": model,
            "stream": stream,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about ferries."}],
        }
    ).encode()
    return urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )


def tokens_lasting(port: int, seconds: float) -> int:
    """max_tokens of a stream lasting about `seconds` on this host: the time of a short completion, measured
    (a loaded vfs host served the tiny model at 4 to 10 tokens a second)."""
    t0 = time.monotonic()
    with urllib.request.urlopen(chat_request(port, 16, stream=False), timeout=300) as resp:
        assert json.load(resp)["usage"]["completion_tokens"] == 16
    return max(16, min(900, int(seconds * 16 / (time.monotonic() - t0))))


def stream_chat(port: int, max_tokens: int, started: threading.Event, result: dict) -> None:
    """A streamed chat completion; `result` gets its finish reason, whether [DONE] came, and its chunks."""
    req = chat_request(port, max_tokens, stream=True)
    result.update(chunks=0, done=False, finish_reason=None)
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    result["done"] = True
                    break
                chunk = json.loads(line[len("data: ") :])
                result["chunks"] += 1
                started.set()
                for choice in chunk.get("choices", []):
                    result["finish_reason"] = choice.get("finish_reason") or result["finish_reason"]
    except Exception as exc:  # noqa: BLE001 (reported by the test)
        result["error"] = repr(exc)
    finally:
        started.set()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def assert_stream_survives_stop(stack: Stack, service: str, port: int, grace_s: int) -> None:
    """A stream started before `docker compose stop SERVICE` ends normally, the service drained (exit 0,
    not Docker's kill) and compose gave it its stop_grace_period. The stream lasts about 20 s: past the
    10 s after which Docker kills without a stop_grace_period, within the api's 30 s drain."""
    assert stack.inspect(service)["Config"]["StopTimeout"] == grace_s
    max_tokens = tokens_lasting(port, 20)
    started, result = threading.Event(), {}
    client = threading.Thread(target=stream_chat, args=(port, max_tokens, started, result), daemon=True)
    client.start()
    assert started.wait(120), result
    assert "error" not in result, result
    t0 = time.monotonic()
    stack.compose("stop", service, timeout=grace_s + 120)
    stopped_after_s = time.monotonic() - t0
    client.join(60)
    assert result.get("done") and result.get("finish_reason") == "length", (result, stopped_after_s)
    state = stack.inspect(service)["State"]
    assert state["ExitCode"] == 0 and not state["OOMKilled"], state
    logs = stack.compose("logs", "--no-color", service).stdout
    assert '"drained": true' in logs or "drained=True" in logs, logs[-3000:]


def test_the_three_services_on_cpu_serve_and_drain_at_stop(docker, tiny_model_dir, tmp_path):
    stack = Stack(tmp_path, [str(REPO / "compose.cpu.yaml")], tiny_model_dir)
    try:
        stack.compose("up", "-d", "--wait", timeout=UP_TIMEOUT_S)
        assert healthy(stack.api_port)
        worker = stack.inspect("worker")
        assert worker["HostConfig"]["RestartPolicy"]["Name"] in ("no", "")
        assert not worker["HostConfig"].get("DeviceRequests")  # no GPU asked for
        assert_stream_survives_stop(stack, "api", stack.api_port, 40)
    finally:
        stack.down()


def test_the_demo_serves_and_drains_at_stop(docker, tmp_path):
    """`docker compose stop demo` killed a stream in flight: serve drains its api for 30 s, Docker waited 10."""
    stack = Stack(tmp_path, [], tmp_path / "unused-model")
    try:
        stack.compose("--profile", "cpu", "up", "-d", "--wait", "demo", timeout=UP_TIMEOUT_S)
        assert_stream_survives_stop(stack, "demo", stack.demo_port, 60)
    finally:
        stack.down()


def test_a_worker_that_cannot_read_its_model_fails_up_with_its_exit_and_says_permission_denied(
    docker, tiny_model_dir, tmp_path
):
    """A host user's 0600 model.safetensors: the worker (uid 10001) said file-not-found, `up` failed on
    "container ... is unhealthy" after its second start, and Docker went on restarting it."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").chmod(0o600)
    stack = Stack(tmp_path, [str(REPO / "compose.cpu.yaml")], model)
    try:
        done = stack.compose("up", "-d", "--wait", timeout=UP_TIMEOUT_S, check=False)
        assert done.returncode != 0
        assert "dependency failed to start" in done.stderr and "worker-1 exited (2)" in done.stderr, done.stderr
        logs = stack.compose("logs", "--no-color", "worker").stdout
        assert "permission denied: /model/model.safetensors (mode 0600" in logs, logs[-3000:]
        time.sleep(10)  # Docker restarts a container within a second of its exit, when its policy says so
        state = stack.inspect("worker")
        assert state["State"]["Status"] == "exited" and state["RestartCount"] == 0, state["State"]
    finally:
        stack.down()
