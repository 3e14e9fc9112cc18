"""Auto's guard over the host's decode share: keep it only while the decode steps it is part of are shorter.

The split (host_decode.py) prices a host expert by what the host nodes took computing it, but a node costs
the step more than its busy time: the hand-off, the callback thread's wake-up, the pool's barrier waiting
for a descheduled vCPU, and the experts the host computes taking no slot (the hit rate falls). On the
H200, on a day its host was contended (bench/NOTES.md, "Pinned threads and huge pages"), auto decoded the
12-layer Qwen3-30B cut at 33.4 tok/s against 100.0 on the GPU alone, its price refined to 538 µs an expert
and still handing the host one or two misses a layer. So auto measures the step itself.

Windows of decode steps alternate between the share on and the share priced off (the hand-off still
runs and gives the host nothing, so "off" carries the hand-off's own cost and the comparison leans
towards the share). A sample is the wall time from one decode step's end to the next's, with no other
step between them, in the same size bucket. With the scheduler keeping steps ahead, that interval is the
device's step time. Once both modes have `samples` samples in a bucket, the guard keeps the share off if
its median is `margin` shorter there, and on otherwise. It holds that choice for `hold` steps, then
explores again, because the host's contention comes and goes. Nothing here imports torch: the worker's
store feeds it the steps (device_store.py), and the share applies its choice.
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


def bucket_of(tokens: int) -> int | None:
    """The size bucket of a decode step of `tokens` tokens; None past the largest."""
    return next((b for b in BUCKETS if tokens <= b), None)


@dataclass
class ShareGuard:
    """Feed it `step(now, decode_tokens)` for every step the worker finishes (decode_tokens None for a step
    that is not a pure decode step); `share_on` says whether the share should be on for the next steps,
    and `step` returns True when that changed."""

    window: int = 32  # steps a mode keeps before the other is tried, while exploring
    samples: int = 64  # samples of each mode in one bucket before a choice is made
    margin: float = 0.05  # the share goes off only when off is this much shorter
    hold: int = 8192  # steps a choice is kept before exploring again
    share_on: bool = True
    exploring: bool = True
    decisions: list[dict] = field(default_factory=list)  # each choice and its medians, for the log and metrics
    _times: dict = field(default_factory=dict)  # (bucket, on) -> [seconds]
    _last: tuple[float, int | None] | None = None  # (end, bucket) of the step before
    _in_mode: int = 0  # steps in this mode (exploring) or since the choice (holding)
    _settle: int = 0  # steps still to pass before the next sample

    def step(self, now: float, decode_tokens: int | None) -> bool:
        bucket = bucket_of(decode_tokens) if decode_tokens else None
        last, self._last = self._last, (now, bucket)
        if self._settle:
            self._settle -= 1
        elif bucket is not None and last is not None and last[1] == bucket and 0 < now - last[0] <= MAX_INTERVAL_S:
            self._times.setdefault((bucket, self.share_on), []).append(now - last[0])
        self._in_mode += 1
        if not self.exploring:
            if self._in_mode >= self.hold:  # explore again: the host's load may have changed
                self.exploring, self._in_mode, self._times = True, 0, {}
                return self._set(True)
            return False
        decided = self._decide()
        if decided is not None:
            self.exploring, self._in_mode = False, 0
            return self._set(decided)
        if self._in_mode >= self.window:
            self._in_mode = 0
            return self._set(not self.share_on)
        return False

    def _decide(self) -> bool | None:
        """The choice, once a bucket has enough samples of both modes; None before."""
        for b in BUCKETS:
            on, off = self._times.get((b, True), []), self._times.get((b, False), [])
            if len(on) >= self.samples and len(off) >= self.samples:
                on_s, off_s = statistics.median(on), statistics.median(off)
                keep = not off_s < on_s * (1 - self.margin)
                self.decisions.append({"bucket": b, "on_ms": round(on_s * 1e3, 3), "off_ms": round(off_s * 1e3, 3),
                                       "share_on": keep})  # fmt: skip
                return keep
        return None

    def _set(self, on: bool) -> bool:
        changed, self.share_on = on != self.share_on, on
        if changed:
            self._settle = SETTLE_STEPS
        return changed
