"""`ferry serve`: api, scheduler and worker on this host, wired by ipc sockets in a private directory.

The three run as child processes (`ferry scheduler|worker|api`, exactly what compose runs). SIGINT or
SIGTERM stops them all; if one of them exits on its own the others are stopped too and serve exits
non-zero, naming it.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from ferry.shared.defaults import ipc_addresses
from ferry.shared.logging import add_log_level_flag, configure_logging
from ferry.services.api.config import add_api_flags
from ferry.services.scheduler.config import add_step_timeout_flag
from ferry.services.worker.command import add_boot_flag
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args, worker_flag_args

log = structlog.get_logger("serve")
STOP_GRACE_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory or hub id (default: the built-in tiny demo model)")
    add_worker_flags(parser, model_required=False)
    add_api_flags(parser)
    g = parser.add_argument_group("processes")
    g.add_argument("--scheduler-health-port", type=int, default=None, help="scheduler /health and /metrics port (default: none)")
    g.add_argument("--worker-health-port", type=int, default=None, help="worker /health and /metrics port (default: none)")
    add_step_timeout_flag(g)
    add_boot_flag(g)
    add_log_level_flag(parser)


DEMO_MODEL_NAME = "ferry-tiny-demo"


def served_model_name(args: argparse.Namespace, model: str) -> str:
    """The id clients send: --served-model-name, else what --model said (a path or hub id, as
    vLLM does), else a readable name for the demo model rather than its cache path."""
    if args.served_model_name:
        return args.served_model_name
    return model if args.model is not None else DEMO_MODEL_NAME


def child_commands(args: argparse.Namespace, model: str, rundir: Path) -> dict[str, list[str]]:
    api_addr, steps_addr, results_addr = ipc_addresses(rundir)
    ferry = [sys.executable, "-m", "ferry.services.cli"]
    log_level = ["--log-level", args.log_level]
    scheduler = [*ferry, "scheduler", "--api-addr", api_addr, "--steps-addr", steps_addr, "--results-addr", results_addr,
                 "--step-timeout", str(args.step_timeout)]  # fmt: skip
    if args.scheduler_health_port is not None:
        scheduler += ["--health-port", str(args.scheduler_health_port)]
    worker = [*ferry, "worker", *worker_flag_args(boot_config_from_args(args, model)), "--steps-addr", steps_addr,
              "--results-addr", results_addr, "--boot", args.boot]  # fmt: skip
    if args.worker_health_port is not None:
        worker += ["--health-port", str(args.worker_health_port)]
    api = [*ferry, "api", "--model", model, "--scheduler-addr", api_addr, "--host", args.host, "--port", str(args.port),
           "--max-body-size", args.max_body_size, "--served-model-name", served_model_name(args, model)]  # fmt: skip
    if args.api_key is not None:
        api += ["--api-key", args.api_key]
    return {"scheduler": scheduler + log_level, "worker": worker + log_level, "api": api + log_level}


def run(args: argparse.Namespace) -> int:
    configure_logging("serve", args.log_level)
    model = args.model
    if model is None:
        from ferry.services.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
        log.info("demo_model", path=model)
    stopping = False

    def request_stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        log.info("stop_requested", signal=signal.Signals(signum).name)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    rundir = Path(tempfile.mkdtemp(prefix="ferry-"))  # mode 0700: only this user reaches the sockets
    procs: dict[str, subprocess.Popen] = {}
    status = 0
    try:
        for name, cmd in child_commands(args, model, rundir).items():
            procs[name] = subprocess.Popen(cmd)
            log.info("started", child=name, pid=procs[name].pid)
        while not stopping:
            dead = [(n, p.returncode) for n, p in procs.items() if p.poll() is not None]
            if dead:
                log.error("process_exited", child=dead[0][0], exit_status=dead[0][1])
                status = 1
                break
            time.sleep(0.2)
    finally:
        _stop_all(procs)
        shutil.rmtree(rundir, ignore_errors=True)
    log.info("stopped", exit_status=status)
    return status


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    # api first (no new requests), then the worker, then the scheduler
    for name in ("api", "worker", "scheduler"):
        p = procs.get(name)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for name, p in procs.items():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("killing", child=name, pid=p.pid)
            p.kill()
            p.wait()
