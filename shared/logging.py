"""structlog set up once per process, on stderr: human-readable lines when stderr is a terminal,
one JSON object per line otherwise (what log collectors parse), or as `--log-format` says.
Context vars (request ids) are merged in. Records from the standard library's logging (aiohttp,
zmq, ...) go through the same renderer, so a process's log is in one format only. No logged value is
longer than MAX_LOGGED_CHARS (a traceback: MAX_TRACEBACK_CHARS): a value a client or a peer chose (a
16 MiB grammar in an error message) would otherwise make one line of tens of megabytes."""

from __future__ import annotations

import argparse
import logging
import sys

import structlog

LOG_FORMATS = ("auto", "console", "json")
MAX_LOGGED_CHARS = 4096
MAX_TRACEBACK_CHARS = 64 * 1024

_SHARED = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


class _StderrLogger:
    """Writes each line to whatever sys.stderr is at that moment, not the one at configure time:
    loggers are cached on first use, and in-process callers (tests, `ferry generate`) swap stderr."""

    def msg(self, message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = failure = err = msg


def add_log_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="auto",
        help="console: readable lines; json: one JSON object per line; auto (default): console when "
        "stderr is a terminal, else json",
    )


def resolve_log_format(fmt: str) -> str:
    if fmt == "auto":
        return "console" if sys.stderr.isatty() else "json"
    return fmt


def _process_as_logger_name(_logger, _name, event_dict: dict) -> dict:
    """The console renderer prints `logger` as a [prefix]: the process says where a line came from."""
    process = event_dict.pop("process", None)
    if process is not None:
        event_dict.setdefault("logger", process)
    return event_dict


def _capped(value, limit: int, depth: int = 0):
    """`value` with every string (and bytes) in it cut to `limit` characters, marked where cut."""
    if isinstance(value, (str, bytes)):
        if len(value) <= limit:
            return value
        text = value if isinstance(value, str) else repr(value[:limit])
        return f"{text[:limit]}...[{len(value) - limit} more characters]"
    if isinstance(value, (dict, list, tuple)) and depth >= 4:
        return _capped(repr(value), limit)
    if isinstance(value, dict):
        return {_capped(k, limit, depth + 1): _capped(v, limit, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_capped(v, limit, depth + 1) for v in value)
    return value


def cap_values(_logger, _name, event_dict: dict) -> dict:
    """Every field cut to MAX_LOGGED_CHARS; a formatted traceback to MAX_TRACEBACK_CHARS (an exc_info
    the console renderer formats is left to it)."""
    for key, value in event_dict.items():
        if key != "exc_info":
            event_dict[key] = _capped(value, MAX_TRACEBACK_CHARS if key == "exception" else MAX_LOGGED_CHARS)
    return event_dict


def _renderers(fmt: str) -> list:
    if fmt == "console":
        return [_process_as_logger_name, cap_values, structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    return [structlog.processors.format_exc_info, cap_values, structlog.processors.JSONRenderer()]


def configure_logging(process: str, level: str = "info", fmt: str = "auto") -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    fmt = resolve_log_format(fmt)
    structlog.configure(
        processors=[*_SHARED, *_renderers(fmt)],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_: _StderrLogger(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *_renderers(fmt)],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    structlog.contextvars.bind_contextvars(process=process)
