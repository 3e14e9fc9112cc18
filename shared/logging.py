"""structlog set up once per process: one JSON line per event on stderr, context vars (request ids)
merged in. Records from the standard library's logging (aiohttp, zmq, ...) go through the same
renderer, so a process's log is JSON lines only."""

from __future__ import annotations

import argparse
import logging
import sys

import structlog

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


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", help="debug, info, warning or error")


def configure_logging(process: str, level: str = "info") -> None:
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    structlog.configure(
        processors=[*_SHARED, structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *_: _StderrLogger(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
    ))  # fmt: skip
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    structlog.contextvars.bind_contextvars(process=process)
