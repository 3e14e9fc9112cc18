"""An api replica's frozen configuration, built once from flags / FERRY_* variables."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from ferry.services.api import gemma4_format
from ferry.shared.defaults import LOOPBACK
from ferry.shared.errors import ConfigError
from ferry.shared.port_flag import port_number
from ferry.shared.units import parse_bytes
from ferry.shared.wire_keys import WireKeys, add_wire_keys_flag, check_exposure

# the parsers' names (services/api/output_parsers.py registers them; kept here so --help stays light)
# vLLM's names; qwen...glm47 are one parser. "auto": the model family's (ModelFamily.tool_call_parser /
# reasoning_parser, for config.json beside the tokenizer), else qwen / qwen3
TOOL_CALL_PARSERS = ("auto", "qwen", "hermes", "qwen25", "qwen3_coder", "glm45", "glm47", gemma4_format.NAME, "none")
REASONING_PARSERS = ("auto", "qwen3", "deepseek_r1", gemma4_format.NAME, "none")
# how a chat becomes a prompt and the output is read back (services/api/tokenizer.py); "auto": the model's own
CHAT_FORMATS = ("auto", "template", "harmony")

DEFAULT_MAX_BODY = "4MiB"
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_MAX_HEADER = "64KiB"
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0


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
    tool_call_parser: str = "auto"  # output_parsers.TOOL_CALL_PARSERS
    reasoning_parser: str = "auto"  # output_parsers.REASONING_PARSERS
    chat_format: str = "auto"  # CHAT_FORMATS
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # a request's headers, and then its body, must arrive within this
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # on SIGTERM: how long requests in flight may take to finish
    wire_keys: str | None = None  # the CURVE key directory (shared/wire_keys.py); None: no CURVE
    max_header_bytes: int = 64 * 1024  # a request's line and headers together (431 past it)
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open at once; past it a new one gets a 503 and is closed
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a request's headers must arrive within this (408)


def add_api_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("api")
    g.add_argument("--host", default=LOOPBACK, help=f"interface to listen on (default {LOOPBACK}: this host only)")
    g.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require the key on /v1/*, as 'Authorization: Bearer KEY' or 'x-api-key: KEY' (default: open); "
        "prefer FERRY_API_KEY or --api-key-file: a command line is visible to every user of the host",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        help="read the API key from this file (a Docker/Compose secret: /run/secrets/NAME)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and /v1/models lists (default: the model path)",
    )
    g.add_argument(
        "--max-body-size",
        default=DEFAULT_MAX_BODY,
        help=f"largest request body accepted, e.g. 4MiB (default {DEFAULT_MAX_BODY})",
    )
    g.add_argument(
        "--read-timeout",
        type=float,
        default=DEFAULT_READ_TIMEOUT_S,
        help="seconds a client has to send a request's headers, and then as long for its body; a connection "
        f"that takes longer is answered 408 or closed (default {DEFAULT_READ_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--max-header-size",
        default=DEFAULT_MAX_HEADER,
        help="largest request line and headers together, e.g. 64KiB; a larger request is answered 431 "
        f"and closed (default {DEFAULT_MAX_HEADER})",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="most client connections open at once; past it a new connection is answered 503 and closed "
        f"(default {DEFAULT_MAX_CONNECTIONS})",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a client has to send a request's line and headers (from its first byte, or from "
        "the connection's start); later ones are answered 408 and closed "
        f"(default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM, stop admitting (503 with Retry-After) and give requests in flight this many "
        f"seconds to finish before exiting (default {DEFAULT_DRAIN_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default="auto",
        help="how tool calls are read from the model's output: qwen (<tool_call> blocks holding "
        "JSON, as vLLM's hermes and SGLang's qwen25 read, <function=...> XML, as qwen3_coder, or GLM's "
        "<arg_key>/<arg_value> pairs, as glm45 / glm47; all these names are accepted), gemma4 (Gemma 4's "
        "<|tool_call>call:NAME{...}<tool_call|>), none, or auto (default: the model family's, else qwen)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="auto",
        help="how reasoning is read from the output: qwen3 (<think>...</think>, also named "
        "deepseek_r1), gemma4 (Gemma 4's <|channel>thought...<channel|>), none, or auto (default: the model "
        "family's, else qwen3)",
    )
    g.add_argument(
        "--chat-format",
        choices=CHAT_FORMATS,
        default="auto",
        help="how chats are rendered and outputs read: template (the tokenizer's chat template and the "
        "--reasoning-parser / --tool-call-parser text parsers), harmony (gpt-oss: OpenAI's harmony library; "
        "channels become reasoning, tool calls and the answer) or auto (default: harmony for the model families "
        "that speak it and for chat templates that write it, else template)",
    )
    add_wire_keys_flag(g)


def api_key_from_args(args: argparse.Namespace) -> str | None:
    """--api-key (or FERRY_API_KEY), else the contents of --api-key-file; '' (compose's unset variable) is no key."""
    key_file = getattr(args, "api_key_file", None)
    if args.api_key and key_file:
        raise ConfigError("--api-key and --api-key-file both give the key: give only one")
    if key_file:
        try:
            return Path(key_file).read_text().strip() or None
        except OSError as exc:
            raise ConfigError(f"--api-key-file: cannot read {key_file}: {exc.strerror}") from exc
    return args.api_key or None


def api_config_from_args(args: argparse.Namespace, scheduler_addr: str, tokenizer: str) -> ApiConfig:
    sizes = {}
    for flag, default in (("max_body_size", DEFAULT_MAX_BODY), ("max_header_size", DEFAULT_MAX_HEADER)):
        try:
            sizes[flag] = parse_bytes(getattr(args, flag, default))
        except ValueError as exc:
            raise ConfigError(f"--{flag.replace('_', '-')}: {exc}") from exc
    for flag in ("read_timeout", "drain_timeout", "header_timeout", "max_connections", "max_header_size"):
        value = sizes.get(flag, getattr(args, flag, 1))
        if not value > 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    keys = getattr(args, "wire_keys", None) or None
    if keys:
        WireKeys(keys, "api")  # a missing key is a config error at start
    check_exposure("--scheduler-addr", scheduler_addr, keys)
    return ApiConfig(
        host=args.host,
        port=args.port,
        scheduler_addr=scheduler_addr,
        tokenizer=tokenizer,
        served_model_name=args.served_model_name or tokenizer,
        api_key=api_key_from_args(args),
        max_body_bytes=sizes["max_body_size"],
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_format=getattr(args, "chat_format", "auto"),
        read_timeout_s=getattr(args, "read_timeout", DEFAULT_READ_TIMEOUT_S),
        drain_timeout_s=getattr(args, "drain_timeout", DEFAULT_DRAIN_TIMEOUT_S),
        wire_keys=keys,
        max_header_bytes=sizes["max_header_size"],
        max_connections=getattr(args, "max_connections", DEFAULT_MAX_CONNECTIONS),
        header_timeout_s=getattr(args, "header_timeout", DEFAULT_HEADER_TIMEOUT_S),
        # unique per start: a restarted container keeps its hostname and pid 1, and must not
        # inherit the old replica's request ids at the scheduler
        identity=f"api-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
    )
