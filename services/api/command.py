"""`ferry api`: one api replica, configured by flags or FERRY_* variables."""

from __future__ import annotations

import argparse
import os

from ferry.services.api.config import add_api_flags, api_config_from_args
from ferry.shared.defaults import API_ADDR
from ferry.shared.logging import add_log_flags, configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="model directory or hub id (its tokenizer and chat template are used)"
    )
    parser.add_argument("--scheduler-addr", default=API_ADDR, help="the scheduler's ROUTER address")
    add_api_flags(parser)
    add_log_flags(parser)


def run(args: argparse.Namespace) -> int:
    configure_logging("api", args.log_level, args.log_format)
    from ferry.shared.torch_free import forbid_torch

    forbid_torch()  # before transformers is imported (by the tokenizer)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # not its "PyTorch was not found" warning: we know
    import uvloop

    from ferry.services.api.app import serve

    uvloop.run(serve(api_config_from_args(args, args.scheduler_addr, args.model)))
    return 0
