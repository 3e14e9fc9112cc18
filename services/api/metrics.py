"""The api's Prometheus metrics: what clients experienced, plus the scheduler's gauges (from its
heartbeat status) so one scrape of the api shows the whole server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ferry.shared.messages import SchedulerStatus
from ferry.shared.status_gauges import StatusGauges

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ferry_requests", "finished requests by route and outcome", ["route", "outcome"], registry=r)
        self.prompt_tokens = Counter("ferry_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("ferry_generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter("ferry_prefix_cached_tokens", "prompt tokens reused from the prefix cache", registry=r)
        self.ttft = Histogram("ferry_time_to_first_token_seconds", "request arrival to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("ferry_inter_token_latency_seconds", "time between consecutive tokens",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)  # fmt: skip
        self.e2e = Histogram("ferry_e2e_request_latency_seconds", "request arrival to last token", buckets=_LATENCY, registry=r)
        self.status = StatusGauges(r, "ferry_")
        self.kv_usage = Gauge("ferry_kv_cache_usage", "fraction of KV pages held by requests (0..1)", registry=r)
        self.expert_hit_rate = Gauge("ferry_expert_hit_rate", "expert-cache hits / lookups since the worker started", registry=r)
        self.preemptions = Gauge("ferry_preemptions", "requests preempted for lack of KV pages (since the worker started)", registry=r)
        self.ready = Gauge("ferry_ready", "1 when scheduler and worker are ready", registry=r)

    def refresh_from(self, status: SchedulerStatus | None, ready: bool) -> None:
        self.ready.set(1 if ready else 0)
        if status is None:
            return
        self.status.set_from(status)
        if status.kv_pages_total:
            self.kv_usage.set(1 - status.kv_pages_available / status.kv_pages_total)
        lookups = status.expert_hits + status.expert_misses
        self.expert_hit_rate.set(status.expert_hits / lookups if lookups else 0)
        self.preemptions.set(status.preemptions)
