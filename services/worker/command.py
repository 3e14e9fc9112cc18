"""`ferry worker`: one worker process, configured by flags or FERRY_* variables."""

from __future__ import annotations

import argparse
import signal

from ferry.services.worker.flags import add_worker_flags, boot_config_from_args
from ferry.shared.defaults import RESULTS_ADDR, STEPS_ADDR
from ferry.shared.logging import add_log_flags, configure_logging
from ferry.shared.side_http import add_side_http_flags
from ferry.shared.wire_keys import WireKeys, add_wire_keys_flag, check_exposure

DEFAULT_BOOT = "ferry.services.worker.boot:boot_worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_flags(parser)
    g = parser.add_argument_group("worker wiring")
    g.add_argument("--steps-addr", default=STEPS_ADDR, help="the scheduler's step address (we connect)")
    g.add_argument("--results-addr", default=RESULTS_ADDR, help="the scheduler's result address (we connect)")
    add_side_http_flags(g)
    add_wire_keys_flag(g)
    add_boot_flag(g)
    add_log_flags(parser)


def add_boot_flag(group) -> None:
    """`--boot`, for `ferry worker` and `ferry serve` (which passes it on)."""
    group.add_argument(
        "--boot",
        default=DEFAULT_BOOT,
        help="module:function that takes a WorkerBootConfig, loads the model and returns "
        "(executor, plan) (default: the real model)",
    )


def run(args: argparse.Namespace) -> int:
    configure_logging("worker", args.log_level, args.log_format)
    from ferry.services.worker.model_source import check_model_exists
    from ferry.services.worker.service import RANK_FAILURE_EXIT, WorkerConfig, WorkerService

    check_model_exists(args.model, args.revision)  # a missing model fails here, before sockets and ranks
    if args.wire_keys:
        WireKeys(args.wire_keys, "worker")  # a missing key is a config error before the model loads
    for flag, addr in (("--steps-addr", args.steps_addr), ("--results-addr", args.results_addr)):
        check_exposure(flag, addr, args.wire_keys)
    cfg = WorkerConfig(
        args.steps_addr, args.results_addr, args.health_host, args.health_port, args.boot, args.wire_keys or None
    )
    service = WorkerService(cfg, boot_config_from_args(args))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.run()
    return RANK_FAILURE_EXIT if service.rank_failure else 0
