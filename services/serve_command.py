"""`ferry serve`: api, scheduler and worker on this host, wired by ipc sockets in a private directory.

The three run as child processes (`ferry scheduler|worker|api`, exactly what compose runs). SIGINT or
SIGTERM stops them all: the api first, which drains (requests in flight get --drain-timeout to
finish), then the worker and the scheduler. If one of them exits on its own the others are stopped
too and serve exits non-zero, naming it. The children die with serve even when it is killed outright,
stopped children included (PR_SET_PDEATHSIG with SIGKILL), and a launch's socket directory left behind
by a killed serve is removed by the next start.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from ferry.services.api.config import DEFAULT_DRAIN_TIMEOUT_S, add_api_flags
from ferry.services.scheduler.config import (
    add_prefill_coalesce_flag,
    add_prefix_cache_flag,
    add_schedule_ahead_flag,
    add_step_timeout_flag,
    prefill_coalesce_s,
    schedule_ahead_steps,
    speculation_from_args,
)
from ferry.services.scheduler.oracle_drafter import bench_drafts_from_env
from ferry.services.worker.command import add_boot_flag
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args, worker_flag_args
from ferry.shared.child_process import die_with_parent
from ferry.shared.defaults import LOOPBACK, ipc_addresses, rundir_base
from ferry.shared.errors import ConfigError
from ferry.shared.logging import add_log_flags, configure_logging
from ferry.shared.model_flag import add_model_argument
from ferry.shared.port_flag import MAX_PORT, port_number

log = structlog.get_logger("serve")
STOP_GRACE_S = 10.0


def _side_port(text: str) -> int | str:
    if text in ("auto", "off"):
        return text
    try:
        return port_number(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected auto, off or a port number in 1..{MAX_PORT}, got {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "model directory or hub id (default: the built-in tiny demo model)")
    add_worker_flags(parser, model_required=False)
    add_api_flags(parser)
    g = parser.add_argument_group("processes")
    side = (
        f"/health and /metrics port, on {LOOPBACK}: a number, off, or auto (default: the api's --port + {{k}} when "
        "free, else any free port; the chosen port is logged at start)"
    )
    g.add_argument(
        "--scheduler-health-port", type=_side_port, default="auto", help="the scheduler's " + side.format(k=1)
    )
    g.add_argument("--worker-health-port", type=_side_port, default="auto", help="the worker's " + side.format(k=2))
    add_step_timeout_flag(g)
    add_schedule_ahead_flag(g)
    add_prefill_coalesce_flag(g)
    add_prefix_cache_flag(g)
    add_boot_flag(g)
    add_log_flags(parser)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _any_free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def side_ports(args: argparse.Namespace) -> dict[str, int | None]:
    """The scheduler's and the worker's /health + /metrics ports: on by default, so that their series
    (steps, preemptions, expert-cache counters) can be scraped without a restart. `auto` prefers
    --port + 1 and + 2 (what compose.yaml uses), else any free port; `off` serves none."""
    chosen: dict[str, int | None] = {}
    auto = []
    given = {getattr(args, f"{n}_health_port") for n in ("scheduler", "worker")}
    for k, name in ((1, "scheduler"), (2, "worker")):
        value = getattr(args, f"{name}_health_port")
        if value == "off":
            chosen[name] = None
        elif value == "auto":
            preferred = args.port + k
            usable = preferred < 65536 and preferred not in given and _port_free(preferred)
            chosen[name] = preferred if usable else None
            if chosen[name] is None:
                auto.append(name)
        else:
            chosen[name] = value
    for name in auto:  # the preferred port is taken: any free one that is not the api's or the other's
        taken = {args.port, *(p for p in chosen.values() if p is not None)}
        chosen[name] = next(p for p in iter(_any_free_port, None) if p not in taken)
    return chosen


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


DEMO_MODEL_NAME = "ferry-tiny-demo"


def served_model_name(args: argparse.Namespace, model: str) -> str:
    """The id clients send: --served-model-name, else what --model said (a path or hub id, as
    vLLM does), else a readable name for the demo model rather than its cache path."""
    if args.served_model_name:
        return args.served_model_name
    return model if args.model is not None else DEMO_MODEL_NAME


def child_commands(
    args: argparse.Namespace, model: str, rundir: Path, ports: dict[str, int | None] | None = None
) -> dict[str, list[str]]:
    """The three command lines. Nothing secret goes on them (a command line is world-readable in
    /proc): the API key reaches the api as a file in the private run directory (write_api_key)."""
    ports = ports if ports is not None else {"scheduler": None, "worker": None}
    api_addr, steps_addr, results_addr = ipc_addresses(rundir)
    ferry = [sys.executable, "-m", "ferry.services.cli"]
    log_flags = ["--log-level", args.log_level, "--log-format", args.log_format]
    scheduler = [
        *ferry,
        "scheduler",
        "--api-addr",
        api_addr,
        "--steps-addr",
        steps_addr,
        "--results-addr",
        results_addr,
        "--step-timeout",
        str(args.step_timeout),
        "--prefill-coalesce-ms",
        f"{args.prefill_coalesce_ms:g}",
        *(
            ["--schedule-ahead-steps", str(args.schedule_ahead_steps)]
            if args.schedule_ahead
            else ["--no-schedule-ahead"]
        ),
    ]
    if not args.prefix_cache:
        scheduler.append("--no-prefix-cache")
    method, draft_tokens = speculation_from_args(args)
    scheduler += ["--speculative-method", method, "--speculative-tokens", str(draft_tokens)]
    if ports["scheduler"] is not None:
        scheduler += ["--health-port", str(ports["scheduler"])]
    worker = [
        *ferry,
        "worker",
        *worker_flag_args(boot_config_from_args(args, model)),
        "--steps-addr",
        steps_addr,
        "--results-addr",
        results_addr,
        "--boot",
        args.boot,
    ]
    if not args.prefix_cache and args.linear_state_snapshots is None and method == "off":
        # no prefix reuse: the snapshots' memory goes to the other pools (speculation holds hybrids' states in them)
        worker += ["--linear-state-snapshots", "0"]
    if ports["worker"] is not None:
        worker += ["--health-port", str(ports["worker"])]
    api = [
        *ferry,
        "api",
        "--model",
        model,
        "--scheduler-addr",
        api_addr,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--max-body-size",
        args.max_body_size,
        "--served-model-name",
        served_model_name(args, model),
        "--read-timeout",
        str(args.read_timeout),
        "--drain-timeout",
        str(args.drain_timeout),
        *api_passthrough_flags(args, rundir),
    ]
    return {"scheduler": scheduler + log_flags, "worker": worker + log_flags, "api": api + log_flags}


def api_key_path(rundir: Path) -> Path:
    return rundir / "api-key"


def write_api_key(args: argparse.Namespace, rundir: Path) -> None:
    """The key given to serve (--api-key or FERRY_API_KEY), in a 0600 file of the 0700 run directory:
    neither a command line nor an environment (`ps e` shows one) carries it to the api."""
    if args.api_key:
        fd = os.open(api_key_path(rundir), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(args.api_key)


def api_passthrough_flags(args: argparse.Namespace, rundir: Path | None = None) -> list[str]:
    out = []
    if args.api_key_file is not None:  # a path, not the key
        out += ["--api-key-file", args.api_key_file]
    elif args.api_key and rundir is not None:
        out += ["--api-key-file", str(api_key_path(rundir))]
    for name in (
        "tool_call_parser",
        "reasoning_parser",
        "chat_format",
        "max_header_size",
        "max_connections",
        "header_timeout",
    ):
        out += [_flag(name), str(getattr(args, name))]
    return out


def child_environments(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Each child's environment: serve's own, without the API key (the api reads it from its file) and
    without the wire keys (serve wires its children by ipc sockets and ignores them, as it says)."""
    env = dict(os.environ)
    env.pop("FERRY_API_KEY", None)
    env.pop("FERRY_API_KEY_FILE", None)  # serve passes the file it resolved, as a flag
    env.pop("FERRY_WIRE_KEYS", None)
    return {"scheduler": env, "worker": env, "api": dict(env)}


def run(args: argparse.Namespace) -> int:
    configure_logging("serve", args.log_level, args.log_format)
    if args.api_key and args.api_key_file:
        raise ConfigError("--api-key and --api-key-file both give the key: give only one")
    prefill_coalesce_s(args.prefill_coalesce_ms)  # refused here, not by the scheduler after the model loads
    schedule_ahead_steps(args)
    method, _ = speculation_from_args(args)  # refused here, not by the scheduler after the model loads
    bench_drafts_from_env(os.environ, method)  # the bench-only switches, likewise
    if getattr(args, "wire_keys", None):
        log.warning(
            "wire_keys_ignored",
            reason="ferry serve wires its processes by ipc sockets in a private "
            "directory; --wire-keys is for the tcp layout (ferry api|scheduler|worker)",
        )
    model = args.model
    if model is None:
        from ferry.services.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
        log.info("demo_model", path=model)
    else:
        from ferry.services.worker.model_source import check_model_exists

        check_model_exists(model, args.revision)  # a missing model fails here, before three processes start
    stopping = False

    def request_stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        log.info("stop_requested", signal=signal.Signals(signum).name)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        base = rundir_base(tempfile.gettempdir())
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    remove_stale_rundirs(Path(base))
    # mode 0700: only this user reaches the sockets; the name carries serve's pid (see remove_stale_rundirs)
    rundir = Path(tempfile.mkdtemp(prefix=f"ferry-{os.getpid()}-", dir=base))
    procs: dict[str, subprocess.Popen] = {}
    status = 0
    ports = side_ports(args)
    envs = child_environments(args)
    write_api_key(args, rundir)
    try:
        for name, cmd in child_commands(args, model, rundir, ports).items():
            procs[name] = subprocess.Popen(cmd, env=envs[name], preexec_fn=die_with_parent(os.getpid()))
            log.info("started", child=name, pid=procs[name].pid)
        log.info(
            "serving",
            api=f"http://{args.host}:{args.port}/v1",
            metrics={
                "api": f"http://{args.host}:{args.port}/metrics",
                **{n: f"http://{LOOPBACK}:{p}/metrics" for n, p in ports.items() if p is not None},
            },
        )
        while not stopping:
            dead = [(n, p.returncode) for n, p in procs.items() if p.poll() is not None]
            if dead:
                log.error("process_exited", child=dead[0][0], exit_status=dead[0][1])
                status = 1
                break
            time.sleep(0.2)
    finally:
        _stop_all(procs, getattr(args, "drain_timeout", DEFAULT_DRAIN_TIMEOUT_S))
        shutil.rmtree(rundir, ignore_errors=True)
    log.info("stopped", exit_status=status)
    return status


def _stop_all(procs: dict[str, subprocess.Popen], drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
    """The api first: it drains (no new requests; those in flight finish while the worker and the
    scheduler still run), then the worker and the scheduler."""
    api = procs.get("api")
    if api is not None and api.poll() is None:
        api.send_signal(signal.SIGTERM)
        _wait_or_kill("api", api, drain_timeout + STOP_GRACE_S)
    for name in ("worker", "scheduler"):
        p = procs.get(name)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for name, p in procs.items():
        _wait_or_kill(name, p, max(0.1, deadline - time.monotonic()))


def _wait_or_kill(name: str, p: subprocess.Popen, timeout: float) -> None:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("killing", child=name, pid=p.pid)
        p.kill()
        p.wait()


_RUNDIR = re.compile(r"ferry-(\d+)-[A-Za-z0-9_]+$")


def remove_stale_rundirs(tmp: Path) -> list[Path]:
    """Socket directories of earlier launches whose serve is gone (killed outright: nothing ran its
    cleanup), this user's only. Returns what was removed."""
    removed = []
    try:
        entries = list(tmp.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = _RUNDIR.match(d.name)
        if m is None or not d.is_dir() or d.is_symlink():
            continue
        try:
            if d.stat().st_uid != os.getuid() or _serve_alive(int(m.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
        log.info("stale_rundir_removed", path=str(d))
    return removed


def _serve_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True
    return b"serve" in cmd
