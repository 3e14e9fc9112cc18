"""Per-step timestamps for the served step's timeline (bench/profile_serve.py): off unless the
FERRY_STEP_TRACE variable names a directory, where each process appends one JSON line per event
to `<role>-<pid>.jsonl`. Timestamps are time.monotonic() (CLOCK_MONOTONIC, one clock for every
process of the host), so the scheduler's and the worker's lines line up.

A diagnostic, not a flag users need: when the variable is unset every call is one attribute test."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ENV = "FERRY_STEP_TRACE"
FLUSH_EVERY = 256  # lines, or
FLUSH_AFTER_S = 0.25  # seconds since the last write


class StepTrace:
    def __init__(self, role: str, environ=os.environ):
        where = environ.get(ENV)
        self.path = Path(where) / f"{role}-{os.getpid()}.jsonl" if where else None
        self._lines: list[str] = []
        self._flushed = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def add(self, **fields) -> None:
        if self.path is None:
            return
        self._lines.append(json.dumps(fields))
        if len(self._lines) >= FLUSH_EVERY or time.monotonic() - self._flushed > FLUSH_AFTER_S:
            self.flush()

    def flush(self) -> None:
        if self.path is None or not self._lines:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write("\n".join(self._lines) + "\n")
        self._lines = []
        self._flushed = time.monotonic()
