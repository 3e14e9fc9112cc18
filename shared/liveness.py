"""Heartbeat bookkeeping: a peer that has been silent longer than `timeout` is dead (docs/ARCHITECTURE.md §1)."""

from __future__ import annotations

import time

HEARTBEAT_INTERVAL_S = 0.5
PEER_TIMEOUT_S = 2.5  # five missed heartbeats: quick to notice, slow enough for a busy Python process


class Liveness:
    def __init__(self, timeout: float = PEER_TIMEOUT_S, clock=time.monotonic):
        self.timeout = timeout
        self._clock = clock
        self._last: float | None = None

    def beat(self) -> None:
        self._last = self._clock()

    def forget(self) -> None:
        self._last = None

    @property
    def ever_seen(self) -> bool:
        return self._last is not None

    def alive(self) -> bool:
        return self._last is not None and self._clock() - self._last <= self.timeout

    def silent_for(self) -> float | None:
        return None if self._last is None else self._clock() - self._last
