"""The worker's Prometheus metrics, served on its side port."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ferry.plan import expert_formats as F

# (report key, metric name without the _total suffix, help): the expert cache's cumulative counters
EXPERT_COUNTERS = (
    ("hits", "ferry_worker_expert_hits", "expert-cache lookups that found the expert in a GPU slot"),
    ("misses", "ferry_worker_expert_misses", "expert-cache lookups that copied the expert from host RAM"),
    ("bytes_copied", "ferry_worker_expert_copied_bytes", "bytes of expert weights copied host -> GPU"),
    ("copy_time_s", "ferry_worker_expert_copy_seconds", "time the copy stream spent copying missed experts"),
    (
        "exposed_copy_time_s",
        "ferry_worker_expert_exposed_copy_seconds",
        "copy time not hidden behind compute (the compute stream waited for it)",
    ),
    (
        "prefetched",
        "ferry_worker_expert_prefetched",
        "experts copied ahead for the next layer (its router's prediction)",
    ),
    ("prefetch_useful", "ferry_worker_expert_prefetch_useful", "prefetched experts that the layer then routed to"),
    ("prefetch_wasted", "ferry_worker_expert_prefetch_wasted", "prefetched experts that the layer did not route to"),
)


class ExpertCacheCollector:
    """Reads the expert store's cumulative report at scrape time (the store owns the counts;
    copying them into prometheus Counters after every step would be a second bookkeeping)."""

    def __init__(self, report: Callable[[], dict]):
        self.report = report

    def collect(self):
        report = self.report()
        for key, name, text in EXPERT_COUNTERS:
            yield counter(name, text, report[key])
        slots = GaugeMetricFamily("ferry_worker_expert_slots", "GPU expert slots of the plan", labels=["format"])
        slots.add_metric([report.get("expert_format", F.unquantized().name)], report["slots"])
        yield slots
        yield from host_share_metrics(report)


class CompileCollector:
    """Triton kernels compiled after the worker became ready, and the seconds they took."""

    def __init__(self, report: Callable[[], dict]):
        self.report = report

    def collect(self):
        got = self.report()
        yield counter(
            "ferry_worker_kernel_compiles",
            "Triton kernel variants compiled (or loaded from its disk "
            "cache) after the worker was ready: the warm-up missed them",
            got["compiles"],
        )
        yield counter(
            "ferry_worker_kernel_compile_seconds",
            "time those compiles took, which the steps that met them waited",
            got["seconds"],
        )


def counter(name: str, text: str, value: float) -> CounterMetricFamily:
    """One unlabelled counter of a cumulative figure some report holds."""
    family = CounterMetricFamily(name, text)
    family.add_metric([], value)
    return family


# the costs a host share splits by, in its report's costs_ns order (offload/host_compute/prefill_share.py,
# decode_share.py)
COST_PATHS = ("pcie", "host_at_1", "host_per_token", "handoff")


def host_share_metrics(report: dict):
    """The host's share of missed experts (--expert-backend hybrid | cpu | auto): what it computed since
    boot and the calibrated costs its split follows; nothing when the store has no host share."""
    shares = [
        (name, report[key]) for name, key in (("prefill", "host_share"), ("decode", "host_decode")) if report.get(key)
    ]
    if not shares:
        return
    experts = CounterMetricFamily(
        "ferry_worker_host_experts", "missed experts the host computed instead of a copy", labels=["share"]
    )
    costs = GaugeMetricFamily(
        "ferry_worker_host_share_cost_seconds",
        "the costs the host's share splits by (boot's "
        "calibration, the decode share's host price refined in service): one expert over "
        "PCIe, on the host at 1 token and per more token, the hand-off",
        labels=["share", "path"],
    )
    for name, share in shares:
        experts.add_metric([name], share["experts"])
        for path, ns in zip(COST_PATHS, share["costs_ns"]):
            costs.add_metric([name, path], ns / 1e9)
    yield experts
    yield costs
    decode = report.get("host_decode")
    if decode and "busy_ns" in decode:  # the decode graph's host nodes time themselves (host_node.c)
        yield counter(
            "ferry_worker_host_node_busy_seconds",
            "time the decode graph's host nodes spent computing the host's experts",
            decode["busy_ns"] / 1e9,
        )
        yield counter(
            "ferry_worker_host_node_calls", "decode graph host nodes that computed pairs", decode["busy_calls"]
        )
        yield counter(
            "ferry_worker_host_share_refinements",
            "times the decode split's price of a host expert moved toward what the host nodes measured",
            decode["refinements"],
        )
        if "busy_hist" in decode:  # the same calls by wall time: a tail their mean hides
            hist = decode["busy_hist"]
            cumulative = list(itertools.accumulate(hist["counts"]))
            buckets = [(repr(float(b)), c) for b, c in zip(hist["bounds_s"], cumulative)] + [("+Inf", cumulative[-1])]
            yield HistogramMetricFamily(
                "ferry_worker_host_node_call_seconds",
                "wall time of each decode host node "
                "that computed pairs (the layer's share on the host, its threads' wake-up "
                "included)",
                buckets=buckets,
                sum_value=decode["busy_ns"] / 1e9,
            )
    if decode and "handoff" in decode:  # how decode layers reach the host (offload/host_compute/host_handoff.py)
        polled = GaugeMetricFamily(
            "ferry_worker_host_decode_polled",
            "1 where decode layers reach the host by a "
            "polled word in pinned memory (FERRY_HOST_HANDOFF), 0 by graph host nodes",
        )
        polled.add_metric([], 1.0 if decode["handoff"] == "poll" else 0.0)
        yield polled
        yield counter(
            "ferry_worker_host_decode_polled_layers",
            "decode layers the polling thread handed to the host",
            decode.get("polled_layers", 0),
        )
        if "min_tokens" in decode:  # launches of fewer rows hold no hand-off (auto's choice, expert_backends.py)
            fewest = GaugeMetricFamily(
                "ferry_worker_host_decode_min_tokens",
                "the fewest tokens a decode step has for its layers to hand the host a share of their misses",
            )
            fewest.add_metric([], float(decode["min_tokens"]))
            yield fewest
    guard = (decode or {}).get("guard")
    if guard:  # auto's guard over the decode share (offload/host_compute/share_guard.py)
        on = GaugeMetricFamily(
            "ferry_worker_host_decode_share_on",
            "1 while auto's guard keeps the host's decode "
            "share on (its steps measured no longer than without it), 0 while it has it off",
        )
        on.add_metric([], 1.0 if guard["share_on"] else 0.0)
        yield on
        if "scale" in guard:
            scale = GaugeMetricFamily(
                "ferry_worker_host_decode_price_scale",
                "the scale auto's guard applies to the "
                "split's price of a host expert (below 1 the host takes more of each layer; "
                "the one whose decode steps measured shortest), 0 while the share is off",
            )
            scale.add_metric([], guard["scale"] or 0.0)
            yield scale


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("ferry_worker_steps", "steps executed", registry=r)
        self.tokens = Counter("ferry_worker_step_tokens", "tokens processed in steps", registry=r)
        self.step_seconds = Histogram(
            "ferry_worker_step_seconds",
            "wall time of one step",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.batch_size = Histogram(
            "ferry_worker_step_requests", "requests in one step", registry=r, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
        )

    def watch_expert_cache(self, report: Callable[[], dict]) -> None:
        """Export the expert store's counters (called once the executor exists)."""
        self.registry.register(ExpertCacheCollector(report))

    def watch_compiles(self, report: Callable[[], dict]) -> None:
        """Export the kernels compiled in service (compile_watch.py): `report` gives compiles and seconds."""
        self.registry.register(CompileCollector(report))

    def observe_step(self, seconds: float, tokens: int, requests: int) -> None:
        self.steps.inc()
        self.tokens.inc(tokens)
        self.step_seconds.observe(seconds)
        self.batch_size.observe(requests)
