"""The scheduler's Prometheus metrics (its own registry: several services may share a test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from ferry.shared.status_gauges import StatusGauges


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.status = StatusGauges(r, "ferry_scheduler_")
        self.kv_cached = Gauge("ferry_scheduler_kv_pages_cached", "KV pages held by the prefix cache", registry=r)
        self.steps = Counter("ferry_scheduler_steps", "steps sent to the worker", registry=r)
        self.steps_ahead = Counter(
            "ferry_scheduler_steps_ahead",
            "of those, steps sent before the previous step's answer (scheduled ahead)",
            registry=r,
        )
        self.step_tokens = Counter("ferry_scheduler_step_tokens", "tokens sent to the worker in steps", registry=r)
        self.preemptions = Counter("ferry_scheduler_preemptions", "requests preempted for lack of pages", registry=r)
        self.prefix_hits = Counter(
            "ferry_scheduler_prefix_hits",
            "admissions that started from a cached prefix (hybrid models: from a linear-state snapshot)",
            registry=r,
        )
        self.snapshot_evictions = Counter(
            "ferry_scheduler_state_snapshot_evictions",
            "linear-state snapshots dropped (with their KV pages, or for room): hybrid models",
            registry=r,
        )
        self.state_snapshots = Gauge(
            "ferry_scheduler_state_snapshots",
            "linear-state snapshots the prefix cache holds (hybrid models)",
            registry=r,
        )
        self.draft_rows = Counter(
            "ferry_scheduler_draft_rows", "speculative decoding: decoding rows sent with drafts to verify", registry=r
        )
        self.drafted_tokens = Counter(
            "ferry_scheduler_drafted_tokens", "speculative decoding: draft tokens sent to be verified", registry=r
        )
        self.accepted_drafts = Counter(
            "ferry_scheduler_accepted_drafts",
            "speculative decoding: of those, the drafts the target model kept (each a token gained without a step)",
            registry=r,
        )
        self.draft_decisions = Counter(
            "ferry_scheduler_draft_decisions",
            "speculative decoding: decoding rows the draft-length controller chose a number of drafts k for",
            registry=r,
        )
        self.chosen_drafts = Counter(
            "ferry_scheduler_chosen_drafts",
            "speculative decoding: the k's chosen, summed (over draft_decisions: the mean k)",
            registry=r,
        )
        self.draft_misses_added = Counter(
            "ferry_scheduler_draft_misses_added",
            "speculative decoding: expert misses the drafts sent were expected to add (offloaded experts; an estimate)",
            registry=r,
        )
        self.rejected = Counter("ferry_scheduler_rejected_requests", "requests rejected at admission", registry=r)
        self.worker_ready = Gauge("ferry_scheduler_worker_ready", "1 when a worker has reported its pools", registry=r)
