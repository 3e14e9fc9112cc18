"""Auto's guard over the host's decode share (services/worker/offload/host_compute/share_guard.py): it keeps the share
where the decode steps with it are shorter, turns it off where they are longer, climbs to the host price's
scale whose steps are shortest, samples only back-to-back decode steps of one size, and explores again
after holding a choice."""

from __future__ import annotations

import random

import pytest

from ferry.services.worker.offload.host_compute.share_guard import (
    BUCKETS,
    SCALES,
    SETTLE_STEPS,
    START,
    ShareGuard,
    bucket_of,
)


def run(guard: ShareGuard, steps: int, on_s: float, off_s: float, tokens: int = 1, ahead: int = 2) -> list[bool]:
    """Steps whose time is on_s or off_s by the mode they were launched in, `ahead` steps before they end
    (the scheduler's steps ahead); returns the mode after each."""
    now, launched, modes = 0.0, [guard.share_on] * ahead, []
    for _ in range(steps):
        mode = launched.pop(0)
        now += on_s if mode else off_s
        guard.step(now, tokens)
        launched.append(guard.share_on)
        modes.append(guard.share_on)
    return modes


def test_a_share_that_lengthens_the_steps_is_turned_off_and_held_off():
    guard = ShareGuard(window=8, samples=16, hold=400)
    modes = run(guard, 300, on_s=0.030, off_s=0.010)
    assert not guard.exploring and not guard.share_on
    assert guard.decisions[-1]["share_on"] is False and guard.decisions[-1]["bucket"] == 1
    assert guard.decisions[-1]["on_ms"] == 30.0 and guard.decisions[-1]["off_ms"] == 10.0
    decided_at = next(i for i in range(len(modes)) if not guard.exploring and all(not m for m in modes[i:]))
    assert decided_at < 100  # explored for well under the hold
    assert modes.count(True) < 60  # the losing share ran for its windows only


def test_a_share_that_shortens_the_steps_is_kept():
    guard = ShareGuard(window=8, samples=16, hold=400)
    run(guard, 300, on_s=0.008, off_s=0.010)
    assert guard.share_on and not guard.exploring and guard.decisions[-1]["share_on"] is True


def test_within_the_margin_the_share_stays_on():
    guard = ShareGuard(window=8, samples=16, hold=400, margin=0.05)
    run(guard, 300, on_s=0.0102, off_s=0.0100)  # off 2 % shorter: not enough to drop it
    assert guard.share_on and guard.decisions[-1]["share_on"] is True


def test_after_the_hold_it_explores_again_and_follows_the_host():
    guard = ShareGuard(window=8, samples=16, hold=200)
    run(guard, 250, on_s=0.030, off_s=0.010)
    assert not guard.share_on
    run(guard, 600, on_s=0.007, off_s=0.010)  # the host quietened: the next exploration keeps the share
    assert guard.share_on and [d["share_on"] for d in guard.decisions][:2] == [False, True]


def test_only_back_to_back_decode_steps_of_one_size_are_samples():
    guard = ShareGuard(window=1000, samples=4)
    guard.step(0.0, 1)
    guard.step(0.010, None)  # a prefill step: no sample, and the next interval starts after it
    guard.step(0.020, 1)
    guard.step(0.030, 1)  # a sample of 10 ms
    guard.step(0.035, 3)  # another bucket: no sample
    guard.step(0.045, 3)  # a sample in bucket 4
    guard.step(2.0, 3)  # after idling: no sample
    assert sorted(guard._times) == [(1, START), (4, START)]
    assert all(v == [pytest.approx(0.010)] for v in guard._times.values())


def test_the_steps_just_after_a_switch_give_no_sample():
    guard = ShareGuard(window=4, samples=100)
    for i in range(4):
        guard.step(0.01 * i, 1)
    assert not guard.share_on  # the window ended: off now
    n_on = len(guard._times[(1, START)])
    for i in range(4, 4 + SETTLE_STEPS):
        guard.step(0.01 * i, 1)
    assert (1, None) not in guard._times and len(guard._times[(1, START)]) == n_on
    guard.step(0.01 * (4 + SETTLE_STEPS), 1)
    assert len(guard._times[(1, None)]) == 1


def run_scaled(guard: ShareGuard, steps: int, seconds, ahead: int = 2, noise: float = 0.0, seed: int = 0) -> None:
    """Steps whose time is seconds(scale) (scale None: the share off) by the scale they were launched in,
    times a uniform noise of +-`noise`."""
    rng = random.Random(seed)
    now, launched = 0.0, [guard.scale] * ahead
    for _ in range(steps):
        scale = launched.pop(0)
        now += seconds(scale) * (1 + rng.uniform(-noise, noise))
        guard.step(now, 1)
        launched.append(guard.scale)


def bowl(best: float):
    """A step of 10 ms at the best scale, 1 ms more for every 0.1 of scale away from it; 20 ms off."""
    return lambda scale: 0.020 if scale is None else 0.010 + 0.01 * abs(scale - best)


@pytest.mark.parametrize("best", [0.64, 0.5, 0.8])
def test_it_climbs_to_the_scale_with_the_shortest_steps_towards_more_host(best):
    guard = ShareGuard(window=8, samples=16, hold=5000)
    run_scaled(guard, 1500, bowl(best), noise=0.02)
    assert not guard.exploring and guard.scale == best, guard.decisions
    assert guard.decisions[0]["share_on"] is True and guard.decisions[0]["scale"] == START  # first, on against off
    tried = [d["tried"] for d in guard.decisions[1:]]
    assert tried == list(SCALES[2 : SCALES.index(best) + 2])[: len(tried)]  # one step further each time
    assert guard.decisions[-1]["kept"] == best


def test_when_more_host_loses_at_once_it_tries_less_host_once():
    guard = ShareGuard(window=8, samples=16, hold=5000)
    run_scaled(guard, 1500, bowl(1.25))
    assert guard.scale == 1.25 and [d.get("tried") for d in guard.decisions] == [None, 0.8, 1.25]
    guard = ShareGuard(window=8, samples=16, hold=5000)
    run_scaled(guard, 1500, bowl(1.0))  # neither way wins: the share as priced
    assert guard.scale == 1.0 and [d.get("tried") for d in guard.decisions] == [None, 0.8, 1.25]


def test_a_scale_within_the_climb_margin_does_not_move_it():
    guard = ShareGuard(window=8, samples=16, hold=5000, climb_margin=0.05)
    run_scaled(guard, 1500, lambda s: 0.013 if s is None else (0.0098 if s == 0.8 else 0.010))  # 2 % shorter
    assert guard.scale == 1.0 and guard.decisions[1]["kept"] == 1.0


def test_after_the_hold_it_explores_again_from_the_held_scale():
    guard = ShareGuard(window=8, samples=16, hold=10**6)

    def hold_ends() -> None:
        guard.hold = 1
        run_scaled(guard, 1, bowl(1.0))
        guard.hold = 10**6

    run_scaled(guard, 700, bowl(0.64))
    assert guard.scale == 0.64 and not guard.exploring
    hold_ends()
    run_scaled(guard, 1200, lambda s: 0.009 if s is None else 0.012)  # the host got busy: off wins
    assert guard.scale is None and not guard.share_on and not guard.exploring
    assert guard.decisions[-1] == {"bucket": 1, "on_ms": 12.0, "off_ms": 9.0, "scale": 0.64, "share_on": False}
    hold_ends()
    run_scaled(guard, 1500, bowl(0.8))  # quiet again: on at 0.64, more host (0.5) loses, less (0.8) wins
    assert guard.scale == 0.8 and not guard.exploring
    assert [d.get("tried") for d in guard.decisions[-4:]] == [None, 0.5, 0.8, 1.0]


def test_a_climb_held_at_the_most_host_turns_back_when_the_host_gets_busy():
    """Held at the ladder's end (0.5) and explored again: the share still beats off, and the climb, with
    nowhere further towards more host, tries less host at once and follows it back up (review: it held 0.5)."""
    guard = ShareGuard(window=4, samples=8, hold=10**6)
    run_scaled(guard, 1500, bowl(0.0))  # more host always shorter: it climbs to the end
    assert guard.scale == SCALES[-1] and not guard.exploring
    guard.hold = 1
    run_scaled(guard, 1, bowl(1.0))
    guard.hold = 10**6
    busy = {None: 0.0128, 1.0: 0.010, 1.25: 0.0105, 0.8: 0.011, 0.64: 0.012, 0.5: 0.0125}
    run_scaled(guard, 3000, lambda s: busy[s])
    assert guard.scale == 1.0 and not guard.exploring, guard.decisions[-4:]
    assert [d.get("tried") for d in guard.decisions[-5:]] == [None, 0.64, 0.8, 1.0, 1.25]


def test_buckets():
    assert [bucket_of(t) for t in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert BUCKETS[-1] == 8


def run_tail(guard: ShareGuard, steps: int, on_s, off_s: float, ahead: int = 2) -> None:
    """Steps of the share's time on_s(k) (k: the step's index) or off_s, by the mode they were launched in."""
    now, launched = 0.0, [guard.share_on] * ahead
    for k in range(steps):
        mode = launched.pop(0)
        now += on_s(k) if mode else off_s
        guard.step(now, 1)
        launched.append(guard.share_on)


def test_a_share_whose_tail_makes_it_slower_on_average_is_turned_off():
    """6 ms steps with the share, but every third 20 ms (a mean of 10.7 ms), against 8 ms off: the median
    says keep it, the served rate says it loses, and the rate is what decides."""
    guard = ShareGuard(window=8, samples=32, hold=5000)
    run_tail(guard, 600, lambda k: 0.020 if k % 3 == 0 else 0.006, off_s=0.008)
    assert guard.decisions[0]["share_on"] is False and not guard.share_on, guard.decisions


def test_a_lone_hiccup_does_not_turn_off_a_share_that_wins():
    """One 0.4 s pause of the process among the share's samples (8 ms against 10 ms off) is left out."""
    guard = ShareGuard(window=8, samples=32, hold=5000)
    run_tail(guard, 600, lambda k: 0.4 if k == 40 else 0.008, off_s=0.010)
    assert guard.decisions[0]["share_on"] is True and guard.share_on, guard.decisions
