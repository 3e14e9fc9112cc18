"""`ferry worker`: one worker process, configured by flags or FERRY_* variables."""

from __future__ import annotations

import argparse
import signal

from ferry.shared.logging import add_log_flags, configure_logging
from ferry.services.worker.execution_flags import add_execution_flags
from ferry.services.worker.expert_policy_flag import add_expert_policy_flag
from ferry.plan.planner_flags import add_planner_flags

DEFAULT_BOOT = "ferry.services.worker.boot:boot_worker"


def add_worker_model_flags(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    """The flags boot_worker reads (shared with `ferry serve`, where --model is optional)."""
    if model_required:
        parser.add_argument("--model", required=True, help="model directory (safetensors + config.json) or hub id")
    parser.add_argument("--load-format", default="auto", help="auto | safetensors | dummy (random weights of the right shapes)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    add_expert_policy_flag(parser)
    add_execution_flags(parser)
    add_planner_flags(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_model_flags(parser)
    g = parser.add_argument_group("worker wiring")
    g.add_argument("--steps-addr", default="tcp://127.0.0.1:5556", help="the scheduler's step address (we connect)")
    g.add_argument("--results-addr", default="tcp://127.0.0.1:5557", help="the scheduler's result address (we connect)")
    g.add_argument("--health-host", default="127.0.0.1", help="interface for /health and /metrics")
    g.add_argument("--health-port", type=int, default=None, help="port for /health and /metrics (default: none)")
    g.add_argument("--boot", default=DEFAULT_BOOT,
                   help="module:function that loads the model and returns (executor, plan)")  # fmt: skip
    add_log_flags(parser)


def run(args: argparse.Namespace) -> int:
    configure_logging("worker", args.log_level, args.log_format)
    from ferry.services.worker.service import WorkerConfig, WorkerService

    cfg = WorkerConfig(args.steps_addr, args.results_addr, args.health_host, args.health_port, args.boot)
    service = WorkerService(cfg, args)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.run()
    return 0
