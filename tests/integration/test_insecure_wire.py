"""Issue 22, 5: the tcp layout without --wire-keys is refused, loopback included (any local process could
submit requests past the api's key, or forge the worker's heartbeat), unless --insecure-wire
(FERRY_INSECURE_WIRE) says so; and no /health shows the worker's boot id, which a forger would need.
`ferry serve` (ipc) needs neither: tests/integration/test_serve_command.py. Loopback only."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import openai
import pytest

from tests.integration.harness import (
    FAKE_BOOT,
    REPO,
    child_env,
    eventually,
    free_port,
    http_get,
    start_cluster,
    tcp_addresses,
)

FERRY = [sys.executable, "-m", "ferry.services.cli"]


def _commands(model_dir) -> dict[str, list[str]]:
    api, steps, results = tcp_addresses()
    return {
        "scheduler": [*FERRY, "scheduler", "--api-addr", api, "--steps-addr", steps, "--results-addr", results],
        "worker": [
            *FERRY,
            "worker",
            "--model",
            str(model_dir),
            "--boot",
            FAKE_BOOT,
            "--steps-addr",
            steps,
            "--results-addr",
            results,
        ],
        "api": [*FERRY, "api", "--model", str(model_dir), "--scheduler-addr", api, "--port", str(free_port())],
    }


@pytest.mark.parametrize("role", ["scheduler", "worker", "api"])
def test_tcp_without_keys_is_refused_at_start_naming_the_way_out(model_dir, role):
    try:
        done = subprocess.run(
            _commands(model_dir)[role], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ferry {role} started on tcp without keys") from None
    assert done.returncode == 2, done.stderr[-2000:]
    for words in ("tcp", "not authenticated", "--wire-keys DIR", "`ferry keys DIR`", "--insecure-wire"):
        assert words in done.stderr, (words, done.stderr[-2000:])


def test_insecure_wire_is_an_explicit_choice(model_dir, tmp_path):
    """--insecure-wire on each command line starts the tcp layout without keys, and it serves."""
    flag = ["--insecure-wire"]
    c = start_cluster(
        model_dir,
        tmp_path / "run",
        worker_flags=["--max-model-len", "512", *flag],
        api_flags=flag,
        scheduler_flags=flag,
        layout="tcp",
    )
    try:
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=20)
        assert (
            client.completions.create(model="tiny", prompt="on an open wire", max_tokens=3).usage.completion_tokens == 3
        )
    finally:
        c.stop()


def test_no_health_shows_the_worker_boot_id(cluster):
    """The boot id names the worker on the wire: whoever knows it could forge its heartbeat (a step
    "running" for 1e9 s fails every request) where the wire has no keys."""
    boot_ids = re.findall(r'"boot_id": "([0-9a-f]{32})"', cluster.log("scheduler"))  # its worker_ready line
    assert boot_ids, cluster.log("scheduler")[-2000:]
    for port in (cluster.port, cluster.scheduler_health_port, cluster.worker_health_port):
        status, body = http_get(f"http://127.0.0.1:{port}/health")
        assert status == 200 and "boot_id" not in json.loads(body) and boot_ids[-1] not in body, body[:500]


def test_the_variable_says_it_too(model_dir):
    """FERRY_INSECURE_WIRE=1: the scheduler starts on tcp without keys (its /health answers)."""
    port = free_port()
    proc = subprocess.Popen(
        [*_commands(model_dir)["scheduler"], "--health-port", str(port)],
        cwd=REPO,
        env={**child_env(), "FERRY_INSECURE_WIRE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def answers() -> bool:
            try:
                return http_get(f"http://127.0.0.1:{port}/health", timeout=1)[0] in (200, 503)
            except OSError:
                return False

        assert eventually(answers, timeout=30), proc.poll()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("role", ["scheduler", "worker", "api"])
def test_insecure_wire_takes_a_literal_loopback_address_only(model_dir, role):
    """`127.0.0.1.nip.io` is a name (a resolver may give any address), not loopback: with --insecure-wire
    and no keys each process refuses it at start naming its flag, not with ZeroMQ's error at bind."""
    cmd = [a.replace("tcp://127.0.0.1:", "tcp://127.0.0.1.nip.io:") for a in _commands(model_dir)[role]]
    try:
        done = subprocess.run(
            [*cmd, "--insecure-wire"], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"ferry {role} started on a name with --insecure-wire") from None
    assert done.returncode == 2 and "Traceback" not in done.stderr and "ZMQError" not in done.stderr, done.stderr[
        -2000:
    ]
    assert "127.0.0.1.nip.io" in done.stderr and "is a name" in done.stderr, done.stderr[-2000:]
    assert re.search(r"--(api|steps|results|scheduler)-addr tcp://127\.0\.0\.1\.nip\.io", done.stderr), done.stderr[
        -2000:
    ]
