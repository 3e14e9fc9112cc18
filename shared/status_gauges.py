"""The scheduler's load as Prometheus gauges, set from a SchedulerStatus: the scheduler exports them
about itself, and every api replica exports the same values from the scheduler's heartbeat, so one
scrape of either shows them. Only the names' prefix differs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from ferry.shared.messages import SchedulerStatus


class StatusGauges:
    def __init__(self, registry: CollectorRegistry, prefix: str):
        self.running = Gauge(f"{prefix}running_requests", "requests being prefilled or decoded", registry=registry)
        self.waiting = Gauge(f"{prefix}waiting_requests", "requests queued for admission", registry=registry)
        self.kv_total = Gauge(f"{prefix}kv_pages_total", "usable KV pages reported by the worker", registry=registry)
        self.kv_available = Gauge(
            f"{prefix}kv_pages_available", "KV pages free or cached-and-unreferenced", registry=registry
        )

    def set_from(self, status: SchedulerStatus) -> None:
        self.running.set(status.running)
        self.waiting.set(status.waiting)
        self.kv_total.set(status.kv_pages_total)
        self.kv_available.set(status.kv_pages_available)
