"""Expert-cache statistics: per step and cumulative hits, misses, bytes and copy times (docs/ARCHITECTURE.md §3).

"Copy time" is how long the copy stream spent copying misses; "exposed copy time" is how long
the compute stream stood waiting for those copies, i.e. the copy time not hidden behind
compute. On CUDA both come from events that are read only once a step has finished (reading
them earlier would stall the pipeline); on CPU copies are synchronous, so all of it is exposed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class CacheCounters:
    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    copy_time_s: float = 0.0
    exposed_copy_time_s: float = 0.0
    steps: int = 0
    # next-layer prefetch: experts copied ahead, then routed (useful) or not (wasted)
    prefetched: int = 0
    prefetch_useful: int = 0
    prefetch_wasted: int = 0

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    def add(self, other: "CacheCounters") -> None:
        for name in (
            "hits",
            "misses",
            "bytes_copied",
            "copy_time_s",
            "exposed_copy_time_s",
            "steps",
            "prefetched",
            "prefetch_useful",
            "prefetch_wasted",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def prefetch_accuracy(self) -> float:
        """Of the prefetched experts whose layer has looked since, the share that was routed."""
        judged = self.prefetch_useful + self.prefetch_wasted
        return self.prefetch_useful / judged if judged else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "prefetch_accuracy": self.prefetch_accuracy}


@dataclass
class _PendingStep:
    counters: CacheCounters = field(default_factory=CacheCounters)
    copy_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)


class ExpertCacheStats:
    """`last_step` is the most recent finished step, `total` everything since start."""

    def __init__(self) -> None:
        self.total = CacheCounters()
        self.last_step = CacheCounters()
        self._step = _PendingStep()
        self._open = False

    def reset(self) -> None:
        """Forget everything so far (boot's warm-up steps are not traffic)."""
        self.__init__()

    # ---- recording (called by the mechanism) -----------------------------------------------
    def record_lookup(self, hits: int, misses: int, bytes_copied: int) -> None:
        self._open = True
        c = self._step.counters
        c.hits += hits
        c.misses += misses
        c.bytes_copied += bytes_copied

    def record_prefetch(self, prefetched: int, useful: int, wasted: int) -> None:
        c = self._step.counters
        c.prefetched += prefetched
        c.prefetch_useful += useful
        c.prefetch_wasted += wasted

    def record_copy_seconds(self, seconds: float, exposed: float) -> None:
        self._step.counters.copy_time_s += seconds
        self._step.counters.exposed_copy_time_s += exposed

    def record_copy_events(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._step.copy_events.append((start, end))

    def record_stall_events(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._step.stall_events.append((start, end))

    def end_step(self) -> None:
        """Close the current step (no-op if nothing happened in it): resolve its CUDA timings
        (waiting for its last events, which a new step's routing has long passed) and fold it
        into the totals."""
        if not self._open:
            return
        step = self._step
        for start, end in step.copy_events:
            end.synchronize()
            step.counters.copy_time_s += start.elapsed_time(end) / 1e3
        for start, end in step.stall_events:
            end.synchronize()
            step.counters.exposed_copy_time_s += start.elapsed_time(end) / 1e3
        step.counters.steps = 1
        self.last_step = step.counters
        self.total.add(step.counters)
        self._step = _PendingStep()
        self._open = False

    # ---- export ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Cumulative counters with the last finished step under "last_step": the object that
        `ferry generate --json` prints as "expert_cache" and /metrics exports."""
        return {**self.total.to_dict(), "last_step": self.last_step.to_dict()}
