"""shared/liveness.py: silence is counted in the listener's listening time only (issue 22, 3)."""

from __future__ import annotations

from ferry.shared.liveness import Liveness


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_silent_peer_is_lost_after_the_timeout_of_listening():
    clock = Clock()
    live = Liveness(timeout=2.5, clock=clock)
    assert not live.ever_seen and not live.alive() and live.silent_for() is None
    live.beat()
    clock.t += 2.4
    assert live.alive()
    clock.t += 0.2
    assert not live.alive() and abs(live.silent_for() - 2.6) < 1e-9


def test_time_the_listener_was_deaf_is_not_the_peers_silence():
    clock = Clock()
    live = Liveness(timeout=2.5, clock=clock)
    live.beat()
    clock.t += 0.4
    live.deaf()  # a 4 s step: the beats wait unread
    clock.t += 4.0
    assert live.alive() and abs(live.silent_for() - 0.4) < 1e-9
    live.hearing()  # the socket is read: nothing was there
    clock.t += 2.0
    assert live.alive()
    clock.t += 0.2
    assert not live.alive()  # 0.4 + 2.2 s of listening


def test_a_beat_read_while_deaf_restarts_the_count():
    clock = Clock()
    live = Liveness(timeout=2.5, clock=clock)
    live.beat()
    live.deaf()
    clock.t += 1.0
    live.beat()  # read from the backlog after the step
    clock.t += 1.0
    live.hearing()
    clock.t += 2.4
    assert live.alive() and abs(live.silent_for() - 2.4) < 1e-9


def test_a_late_wake_up_is_excused():
    clock = Clock()
    live = Liveness(timeout=2.5, clock=clock)
    live.beat()
    clock.t += 3.5  # the listener's loop stood still
    live.excuse(3.0)
    assert live.alive() and abs(live.silent_for() - 0.5) < 1e-9
    live.excuse(1.0)
    live.beat()  # excuses do not carry over a beat
    clock.t += 2.6
    assert not live.alive()
