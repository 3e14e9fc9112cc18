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
        self.decode_step = Gauge(
            f"{prefix}speculative_decode_step_seconds",
            "speculative decoding: a decode graph's replay as the worker times it on the device, the draft-length "
            "controller's running estimate (0: not measured yet)",
            registry=registry,
        )
        self.verify_step = Gauge(
            f"{prefix}speculative_verify_step_seconds",
            "speculative decoding: an eager step verifying drafts as the worker times it on the device, the "
            "draft-length controller's running estimate (0: not measured yet)",
            registry=registry,
        )
        self.verify_wall = Gauge(
            f"{prefix}speculative_verify_wall_seconds",
            "speculative decoding: a step verifying drafts from the scheduler's send to its answer, its MTP chain's "
            "device time left out, the draft-length controller's running estimate (0: not measured yet)",
            registry=registry,
        )
        self.chain_position = Gauge(
            f"{prefix}speculative_chain_position_seconds",
            "speculative decoding: an MTP draft chain's seconds a position as the worker times it on the device, "
            "the draft-length controller's running estimate (0: not measured yet)",
            registry=registry,
        )

    def set_from(self, status: SchedulerStatus) -> None:
        self.running.set(status.running)
        self.waiting.set(status.waiting)
        self.kv_total.set(status.kv_pages_total)
        self.kv_available.set(status.kv_pages_available)
        self.decode_step.set(status.draft_decode_step_s)
        self.chain_position.set(status.draft_chain_position_s)
        self.verify_step.set(status.draft_verify_step_s)
        self.verify_wall.set(status.draft_verify_wall_s)
