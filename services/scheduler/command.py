"""`ferry scheduler`: one scheduler process, configured by flags or FERRY_* variables."""

from __future__ import annotations

import argparse
import signal

from ferry.services.scheduler.config import add_scheduler_flags, scheduler_config_from_args
from ferry.shared.logging import add_log_flags, configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scheduler_flags(parser)
    add_log_flags(parser)


def run(args: argparse.Namespace) -> int:
    configure_logging("scheduler", args.log_level, args.log_format)
    from ferry.shared.torch_free import forbid_torch

    forbid_torch()
    from ferry.services.scheduler.service import SchedulerService

    service = SchedulerService(scheduler_config_from_args(args))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.run()
    return 0
