"""The expert cache's figures over a span of steps (one request of `ferry generate`), from the
store's cumulative report taken before and after: counters are differences, the rest is as after."""

from __future__ import annotations

COUNTERS = (
    "hits",
    "misses",
    "bytes_copied",
    "copy_time_s",
    "exposed_copy_time_s",
    "steps",
    "prefetched",
    "prefetch_useful",
    "prefetch_wasted",
)
STEP_FIELDS = (
    "hits",
    "misses",
    "bytes_copied",
    "copy_time_s",
    "exposed_copy_time_s",
    "prefetched",
    "prefetch_useful",
    "prefetch_wasted",
)


def report_delta(before: dict, after: dict) -> dict:
    out = {k: v for k, v in after.items() if k not in COUNTERS and k not in ("hit_rate", "last_step")}
    out.update({k: after[k] - before[k] for k in COUNTERS})
    looked_up = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / looked_up if looked_up else 0.0
    judged = out["prefetch_useful"] + out["prefetch_wasted"]
    out["prefetch_accuracy"] = out["prefetch_useful"] / judged if judged else 0.0
    return out


def step_figures(report: dict) -> dict:
    """The last finished step's counters from a report."""
    return {k: report["last_step"][k] for k in STEP_FIELDS}
