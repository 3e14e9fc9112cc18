"""An api replica's frozen configuration, built once from flags / FERRY_* variables."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass

from ferry.shared.defaults import LOOPBACK
from ferry.shared.errors import ConfigError
from ferry.shared.units import parse_bytes

DEFAULT_MAX_BODY = "4MiB"


@dataclass(frozen=True)
class ApiConfig:
    host: str
    port: int
    scheduler_addr: str
    tokenizer: str  # directory or hub id with the tokenizer and chat template
    served_model_name: str
    api_key: str | None
    max_body_bytes: int
    identity: str  # this replica's DEALER identity, unique among replicas


def add_api_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("api")
    g.add_argument("--host", default=LOOPBACK, help=f"interface to listen on (default {LOOPBACK}: this host only)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: open)")
    g.add_argument("--served-model-name", default=None, help="the model id clients send and /v1/models lists (default: the model path)")
    g.add_argument("--max-body-size", default=DEFAULT_MAX_BODY, help=f"largest request body accepted, e.g. 4MiB (default {DEFAULT_MAX_BODY})")


def api_config_from_args(args: argparse.Namespace, scheduler_addr: str, tokenizer: str) -> ApiConfig:
    try:
        max_body = parse_bytes(args.max_body_size)
    except ValueError as exc:
        raise ConfigError(f"--max-body-size: {exc}") from exc
    return ApiConfig(
        host=args.host, port=args.port, scheduler_addr=scheduler_addr, tokenizer=tokenizer,
        served_model_name=args.served_model_name or tokenizer, api_key=args.api_key or None,  # '' from compose: no key
        max_body_bytes=max_body,
        # unique per start: a restarted container keeps its hostname and pid 1, and must not
        # inherit the old replica's request ids at the scheduler
        identity=f"api-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
    )  # fmt: skip
