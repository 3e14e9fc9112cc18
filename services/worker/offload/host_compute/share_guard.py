"""Auto's guard over the host's decode share: keep it only while the decode steps it is part of are shorter,
and give it the size whose steps are shortest.

The split (decode_share.py) prices a host expert by what the host nodes took computing it, but a node costs the step
more than its busy time: the hand-off, the callback thread's wake-up, the pool's barrier waiting for a descheduled
vCPU, and the experts the host computes taking no slot (the hit rate falls). On a contended host, auto priced by the
nodes alone decoded the 12-layer Qwen3-30B cut at 33.4 tok/s against 100.0 on the GPU alone, its price refined to
538 µs an expert and still handing the host one or two misses a layer. And on a quiet day the same cut ran faster
with a host share larger than "both end together" gives it (a cache-warm price of 104 µs: 1.42x the GPU alone,
against 1.29x with the nodes' 138 µs), the link's side of a layer paying more than its copies. So auto measures the
step itself, and the split's price of a host expert is scaled by what measured fastest.

Windows of decode steps alternate between two modes, an incumbent and a challenger; a mode is a scale of the host's
one-token price (below 1: the host takes more of each layer) or None, the share priced off (the hand-off still runs
and gives the host nothing, so "off" carries the hand-off's own cost and the comparison leans towards the share). A
sample is the wall time from one decode step's end to the next's, with no other step between them, in the same size
bucket. With the scheduler keeping steps ahead, that interval is the device's step time. Once both modes have
`samples` samples in a bucket, their means decide, the longest 1/32 of each left out (`typical`): a served rate is
the mean interval, and the host's share can add a tail a median does not see (a single stream can run ~1 ms a token
past the guard's medians), while a lone hiccup of the process, which has nothing to do with the share, stays out:

1. the share (scale 1) against off: off wins only if `margin` shorter; then it is held off;
2. while the share is on, the next scale of SCALES towards more host challenges the incumbent and takes
   its place if `climb_margin` shorter, then the next one; if the first step towards more host loses,
   one towards less host (1.25) is tried.

The choice is held for `hold` steps, then explored again from step 1 (the held scale against off), because
the host's contention comes and goes. Nothing here imports torch: the worker's store feeds it the steps
(stores/device_driven.py), and the share applies its scale.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# decode steps of these many tokens or fewer share a bucket: a step's time grows with its tokens
BUCKETS = (1, 2, 4, 8)
# a gap longer than this between two steps' ends is idleness, not a step
MAX_INTERVAL_S = 0.5
# steps after a switch that give no sample: the steps already queued ahead ran with the costs before it
SETTLE_STEPS = 3


def typical(seconds: list[float]) -> float:
    """A mode's step time for a decision: the mean of its samples without the longest 1/32 of them."""
    kept = sorted(seconds)[: len(seconds) - len(seconds) // 32]
    return statistics.fmean(kept)


def bucket_of(tokens: int) -> int | None:
    """The size bucket of a decode step of `tokens` tokens; None past the largest."""
    return next((b for b in BUCKETS if tokens <= b), None)


# the host's one-token price is scaled by one of these (the split gives the host more of a layer below 1);
# a climb starts at START and walks towards more host, or one step towards less if the first step loses
SCALES = (1.25, 1.0, 0.8, 0.64, 0.5)
START = 1.0
UNDECIDED = object()  # _decide's answer before a bucket has its samples (None is a choice: off)


@dataclass
class ShareGuard:
    """Feed it `step(now, decode_tokens)` for every step the worker finishes (decode_tokens None for a step
    that is not a pure decode step); `scale` says how the share should price a host expert for the next
    steps (None: off), `share_on` whether it is on, and `step` returns True when the scale changed."""

    window: int = 32  # steps a mode keeps before the other is tried, while exploring
    samples: int = 64  # samples of each mode in one bucket before a choice is made
    margin: float = 0.05  # the share goes off only when off is this much shorter
    climb_margin: float = 0.02  # another scale replaces the incumbent only when this much shorter
    hold: int = 8192  # steps a choice is kept before exploring again
    scale: float | None = START  # what the share applies now (None: priced off)
    exploring: bool = True
    decisions: list[dict] = field(default_factory=list)  # each choice and its typical steps, for the log and metrics
    _incumbent: float | None = START
    _challenger: float | None = None  # None: the share off (step 1)
    _direction: int = -1  # the climb's way along SCALES: -1 towards more host (smaller scales), +1 less
    _moved: bool = False  # whether this climb has replaced its first incumbent
    _times: dict = field(default_factory=dict)  # (bucket, mode) -> [seconds]
    _last: tuple[float, int | None] | None = None  # (end, bucket) of the step before
    _in_mode: int = 0  # steps in this mode (exploring) or since the choice (holding)
    _settle: int = 0  # steps still to pass before the next sample

    @property
    def share_on(self) -> bool:
        return self.scale is not None

    def step(self, now: float, decode_tokens: int | None) -> bool:
        bucket = bucket_of(decode_tokens) if decode_tokens else None
        last, self._last = self._last, (now, bucket)
        if self._settle:
            self._settle -= 1
        elif bucket is not None and last is not None and last[1] == bucket and 0 < now - last[0] <= MAX_INTERVAL_S:
            self._times.setdefault((bucket, self.scale), []).append(now - last[0])
        self._in_mode += 1
        if not self.exploring:
            if self._in_mode >= self.hold:  # explore again: the host's load may have changed
                kept = self.scale if self.scale is not None else self._incumbent
                self._compare(kept, None)
                self._moved = False
                self.exploring, self._in_mode = True, 0
                return self._set(kept)
            return False
        decided = self._decide()
        if decided is not UNDECIDED:
            self._in_mode = 0
            return self._set(decided)
        if self._in_mode >= self.window:
            self._in_mode = 0
            return self._set(self._challenger if self.scale == self._incumbent else self._incumbent)
        return False

    def _compare(self, incumbent: float | None, challenger: float | None) -> None:
        self._incumbent, self._challenger, self._times = incumbent, challenger, {}

    def _decide(self):
        """The scale to run next (None: off) once a bucket has enough samples of both modes, which starts
        the next comparison or holds a choice; UNDECIDED before."""
        for b in BUCKETS:
            inc, cha = self._times.get((b, self._incumbent), []), self._times.get((b, self._challenger), [])
            if len(inc) >= self.samples and len(cha) >= self.samples:
                return self._next(b, typical(inc), typical(cha))
        return UNDECIDED

    def _next(self, bucket: int, inc_s: float, cha_s: float) -> float | None:
        record = {"bucket": bucket}
        if self._challenger is None:  # step 1: the share against off
            keep = not cha_s < inc_s * (1 - self.margin)
            self.decisions.append(
                record
                | {
                    "on_ms": round(inc_s * 1e3, 3),
                    "off_ms": round(cha_s * 1e3, 3),
                    "scale": self._incumbent,
                    "share_on": keep,
                }
            )
            if not keep:
                return self._hold(None)
            self._direction = -1
            return self._climb(self._incumbent)
        won = cha_s < inc_s * (1 - self.climb_margin)
        best = self._challenger if won else self._incumbent
        self.decisions.append(
            record
            | {
                "scale": self._incumbent,
                "scale_ms": round(inc_s * 1e3, 3),
                "tried": self._challenger,
                "tried_ms": round(cha_s * 1e3, 3),
                "share_on": True,
                "kept": best,
            }
        )
        if won:
            self._moved = True
            return self._climb(best)
        if self._direction < 0 and not self._moved:  # more host lost at once: try less host, once
            self._direction = 1
            return self._climb(best)
        return self._hold(best)

    def _climb(self, incumbent: float) -> float:
        """The next comparison of this climb from `incumbent`, or hold it where SCALES end. A climb that
        starts at the end towards more host (a scale held from an earlier climb, explored again) turns
        towards less host at once: the host's load may have risen since."""
        i = SCALES.index(incumbent) - self._direction  # SCALES run from less host to more
        if not 0 <= i < len(SCALES) and self._direction < 0 and not self._moved:
            self._direction = 1
            i = SCALES.index(incumbent) - self._direction
        if not 0 <= i < len(SCALES):
            return self._hold(incumbent)
        self._compare(incumbent, SCALES[i])
        return incumbent

    def _hold(self, scale: float | None) -> float | None:
        self.exploring = False
        if scale is not None:
            self._incumbent = scale
        return scale

    def _set(self, scale: float | None) -> bool:
        changed, self.scale = scale != self.scale, scale
        if changed:
            self._settle = SETTLE_STEPS
        return changed
