"""`ferry serve` as a child process for the benchmarks and the GPU check: start it on free ports,
wait until /health says ready, stop it with SIGTERM and report whether it and its children exited."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    worker_port: int
    scheduler_port: int
    command: str
    log: object = field(repr=False)
    ready_s: float | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def worker_metrics(self) -> str:
        return f"http://127.0.0.1:{self.worker_port}/metrics"

    @property
    def scheduler_metrics(self) -> str:
        return f"http://127.0.0.1:{self.scheduler_port}/metrics"

    def wait_ready(self, timeout: float) -> float:
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ferry serve exited with {self.proc.returncode} before it was ready")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"ferry serve was not ready after {timeout:.0f} s")
            try:
                if http_get(self.base + "/health", 2)[0] == 200:
                    self.ready_s = time.monotonic() - t0
                    return self.ready_s
            except OSError:
                pass
            time.sleep(1)

    def stop(self, timeout: float = 60) -> dict:
        """SIGTERM; {"exit_status", "children", "children_left"} once it is gone."""
        children = children_of(self.proc.pid) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = f"killed after {timeout:.0f} s"
        time.sleep(0.5)
        self.log.close()
        return {"exit_status": rc, "children": len(children), "children_left": [p for p in children if alive(p)]}


def start_serve(model_dir: str | Path, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> Served:
    """`ferry serve` on free ports with `args`, its output in `log_path`; `env`: variables set for it alone."""
    port, worker_port, scheduler_port = free_port(), free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "ferry.services.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--worker-health-port",
        str(worker_port),
        "--scheduler-health-port",
        str(scheduler_port),
        *args,
    ]
    log = Path(log_path).open("w")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **env} if env else None,
    )
    shown = [f"{k}={v}" for k, v in (env or {}).items()]  # the command as a shell would run it
    return Served(proc, port, worker_port, scheduler_port, " ".join([*shown, "ferry", *cmd[3:]]), log)


def make_bench_model(out: Path, config: Path, num_layers: int | None = None, fmt: str = "bf16") -> Path:
    """A bench model directory (config in expert format `fmt`: bf16, nvfp4, fp8, mxfp4), for --load-format dummy;
    for gguf-TYPE the GGUF file of random blocks itself (its weights: served as read)."""
    from ferry.services.bench_model import GGUF_PREFIX

    cmd = [
        sys.executable,
        "-m",
        "ferry.services.cli",
        "make-bench-model",
        str(out),
        "--config",
        str(config),
        "--format",
        fmt,
    ]
    if num_layers is not None:
        cmd += ["--num-layers", str(num_layers)]
    if fmt.startswith(GGUF_PREFIX):
        cmd += ["--weights", "random"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return out
