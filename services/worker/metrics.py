"""The worker's Prometheus metrics, served on its side port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("ferry_worker_steps", "steps executed", registry=r)
        self.tokens = Counter("ferry_worker_step_tokens", "tokens processed in steps", registry=r)
        self.step_seconds = Histogram(
            "ferry_worker_step_seconds", "wall time of one step", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )  # fmt: skip
        self.batch_size = Histogram("ferry_worker_step_requests", "requests in one step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))  # fmt: skip

    def observe_step(self, seconds: float, tokens: int, requests: int) -> None:
        self.steps.inc()
        self.tokens.inc(tokens)
        self.step_seconds.observe(seconds)
        self.batch_size.observe(requests)
