"""Heartbeat bookkeeping: a peer that has been silent longer than `timeout` is dead (docs/ARCHITECTURE.md §1).

Silence is counted in the listener's listening time only. A listener that is busy (a worker in a long
step), or that was not scheduled at all (a loaded host), has not heard its peer, but its peer may well
have spoken: the beats wait unread in its socket. So a listener marks the time it does not read its
inbox (`deaf()` until `hearing()`, or `excuse(seconds)` once it notices it woke late), and that time
is not the peer's silence. Senders beat from a thread or a timer of their own, never behind work; with
both, a busy process is never declared lost, and a dead one still is within `timeout` of listening.
"""

from __future__ import annotations

import time

HEARTBEAT_INTERVAL_S = 0.5
PEER_TIMEOUT_S = 2.5  # five missed heartbeats: quick to notice, slow enough for a busy Python process


class Liveness:
    """One peer's beats as one listener heard them. The state is one tuple, replaced whole, so a
    /health thread reads a consistent view while the listener's loop updates it."""

    def __init__(self, timeout: float = PEER_TIMEOUT_S, clock=time.monotonic):
        self.timeout = timeout
        self._clock = clock
        # (last beat, deaf seconds since it, start of the deaf spell now running or None)
        self._state: tuple[float | None, float, float | None] = (None, 0.0, None)

    def beat(self) -> None:
        now = self._clock()
        deaf_since = self._state[2]
        self._state = (now, 0.0, None if deaf_since is None else now)

    def forget(self) -> None:
        self._state = (None, 0.0, self._state[2])

    def deaf(self) -> None:
        """The listener stops reading its inbox (busy): from now on, silence is not the peer's."""
        last, excused, since = self._state
        if since is None:
            self._state = (last, excused, self._clock())

    def hearing(self) -> None:
        """The listener has read everything waiting for it, and reads again."""
        last, excused, since = self._state
        if since is not None:
            self._state = (last, excused + max(0.0, self._clock() - since), None)

    def excuse(self, seconds: float) -> None:
        """The listener was not running for `seconds` (it woke that late): not the peer's silence."""
        last, excused, since = self._state
        if last is not None and seconds > 0:
            self._state = (last, excused + seconds, since)

    @property
    def ever_seen(self) -> bool:
        return self._state[0] is not None

    def alive(self) -> bool:
        silent = self.silent_for()
        return silent is not None and silent <= self.timeout

    def silent_for(self) -> float | None:
        """Seconds the listener listened without hearing the peer (None: never heard)."""
        last, excused, since = self._state
        if last is None:
            return None
        now = self._clock()
        deaf_now = 0.0 if since is None else max(0.0, now - since)
        return max(0.0, now - last - excused - deaf_now)
