"""The api's connection handler (services/api/connection.py) in what the real-process tests cannot
pin down: when the heap is trimmed after closed connections, and the open-file limit the connection cap
needs. The caps themselves, against a real api process over raw sockets: tests/integration/test_http_caps.py."""

from __future__ import annotations

import asyncio
import platform

from ferry.services.api.connection import TRIM_AFTER_CLOSED, TRIM_INTERVAL_S, _Trim


class _Loop:
    """call_later, run_in_executor and time, by hand."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.scheduled: list[tuple[float, object]] = []
        self.in_executor = 0  # calls made off the loop

    def run_in_executor(self, executor, fn, *args):
        self.in_executor += 1
        fn(*args)

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, fn):
        self.scheduled.append((delay, fn))
        return object()

    def run_scheduled(self) -> None:
        due, self.scheduled = self.scheduled, []
        for delay, fn in due:
            self.now += delay
            fn()


def test_the_heap_is_trimmed_after_enough_closed_connections_and_not_more_often_than_the_interval():
    loop = _Loop()
    trim = _Trim(loop)
    calls = []
    trim._fn = calls.append
    for _ in range(TRIM_AFTER_CLOSED - 1):
        trim.connection_closed()
    assert loop.scheduled == []
    trim.connection_closed()
    assert [delay for delay, _ in loop.scheduled] == [0.0]  # the first: at once
    loop.run_scheduled()
    assert calls == [0]
    for _ in range(3 * TRIM_AFTER_CLOSED):  # a flood goes on: one trim pending at a time
        trim.connection_closed()
    assert [delay for delay, _ in loop.scheduled] == [TRIM_INTERVAL_S]
    loop.run_scheduled()
    assert calls == [0, 0] and loop.in_executor == 2  # the heap walk never ran on the event loop


def test_malloc_trim_is_found_under_glibc():
    if platform.libc_ver()[0] != "glibc":
        return
    loop = asyncio.new_event_loop()
    try:
        assert _Trim(loop)._fn is not None
    finally:
        loop.close()


class _Limits:
    def __init__(self, soft: int, hard: int) -> None:
        self.soft, self.hard = soft, hard

    def getrlimit(self, _which):
        return self.soft, self.hard

    def setrlimit(self, _which, limits):
        soft, hard = limits
        if soft > self.hard:
            raise ValueError("not allowed to raise maximum limit")
        self.soft, self.hard = soft, hard


def test_the_open_file_limit_is_raised_for_the_connection_cap_or_the_flag_is_named(monkeypatch):
    from structlog.testing import capture_logs

    from ferry.services.api import connection

    limits = _Limits(1024, 1 << 20)
    monkeypatch.setattr(connection.resource, "getrlimit", limits.getrlimit)
    monkeypatch.setattr(connection.resource, "setrlimit", limits.setrlimit)
    with capture_logs() as logs:
        connection.raise_fd_limit(4000)
    assert limits.soft == 4000 + connection.FD_RESERVE and not logs
    limits.soft, limits.hard = 1024, 2048
    with capture_logs() as logs:
        connection.raise_fd_limit(4000)
    assert limits.soft == 2048
    assert [e["event"] for e in logs] == ["fd_limit_low"] and "--max-connections 4000" in logs[0]["message"]
