"""The api's Prometheus metrics: what clients experienced, plus the scheduler's gauges (from its
heartbeat status) so one scrape of the api shows the whole server.

`vllm:` aliases: the series a vLLM dashboard reads, under vLLM's names and with its `model_name`
label, copied from Ferry's own at scrape time (README: "Metrics for vLLM dashboards")."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from ferry.shared.messages import FINISH_REASONS, SchedulerStatus
from ferry.shared.status_gauges import StatusGauges

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# Ferry's family -> vLLM's names for it (the same series: same type, meaning and unit; the second name
# of a pair is what vLLM called it before its V1 engine, which older dashboards still read)
VLLM_ALIASES = {
    "ferry_running_requests": ("vllm:num_requests_running",),
    "ferry_waiting_requests": ("vllm:num_requests_waiting",),
    "ferry_kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "ferry_prompt_tokens": ("vllm:prompt_tokens",),
    "ferry_generation_tokens": ("vllm:generation_tokens",),
    "ferry_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "ferry_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "ferry_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "ferry_preemptions": ("vllm:num_preemptions",),
    "ferry_prefix_cached_tokens": ("vllm:prefix_cache_hits",),
    "ferry_speculative_draft_rows": ("vllm:spec_decode_num_drafts",),
    "ferry_speculative_drafted_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "ferry_speculative_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
}
# vLLM's finished_reason label from Ferry's request outcome (errors are not "finished")
FINISHED_REASONS = {"stop": "stop", "length": "length", "disconnected": "abort"}

# Set on an aiohttp request once its generations run: each Generation counts itself in ferry_requests_total
# however it ends, and the error middleware (http_errors.py) counts only the requests none counted.
_COUNTED_KEY = web.RequestKey("ferry_counted_by_generations", bool)


def mark_counted_by_generations(request) -> None:
    request[_COUNTED_KEY] = True


def counted_by_generations(request) -> bool:
    return request.get(_COUNTED_KEY, False)


class _StatusCounters:
    """Counters whose value the scheduler keeps (its heartbeat status carries it): exported as
    counters, not gauges, so rate() works; a restarted scheduler starts again from 0, which
    Prometheus reads as a counter reset."""

    FAMILIES = {
        "preemptions": ("ferry_preemptions", "requests preempted for lack of KV pages (since the worker started)"),
        "prefix_hits": (
            "ferry_prefix_cache_hits",
            "requests admitted from a cached prefix (hybrid models: from a "
            "linear-state snapshot; since the worker started)",
        ),
        "snapshot_evictions": (
            "ferry_state_snapshot_evictions",
            "linear-state snapshots of hybrid models dropped, "
            "with their KV pages or for room (since the worker started)",
        ),
        "draft_rows": (
            "ferry_speculative_draft_rows",
            "speculative decoding: decoding rows sent with drafts to verify (since the worker started)",
        ),
        "drafted_tokens": (
            "ferry_speculative_drafted_tokens",
            "speculative decoding: draft tokens sent to be verified (since the worker started)",
        ),
        "accepted_drafts": (
            "ferry_speculative_accepted_tokens",
            "speculative decoding: draft tokens the target model kept (since the worker started)",
        ),
        "draft_decisions": (
            "ferry_speculative_k_decisions",
            "speculative decoding: decoding rows the draft-length controller chose a number of drafts k for "
            "(since the worker started)",
        ),
        "chosen_drafts": (
            "ferry_speculative_k_chosen",
            "speculative decoding: the k's chosen, summed; over ferry_speculative_k_decisions: the mean k",
        ),
        "draft_misses_added": (
            "ferry_speculative_estimated_misses_added",
            "speculative decoding: expert misses the drafts sent were expected to add, with experts offloaded "
            "(the controller's estimate; since the worker started)",
        ),
    }

    def __init__(self) -> None:
        self.values = dict.fromkeys(self.FAMILIES, 0)

    @property
    def preemptions(self) -> int:
        return self.values["preemptions"]

    def collect(self):
        for key, (name, doc) in self.FAMILIES.items():
            family = CounterMetricFamily(name, doc)
            family.add_metric([], self.values[key])
            yield family


class _SegmentCounters:
    """The api tokenizer's segment cache (segment_cache.py), read at scrape time: segments of long prompts
    found there and segments tokenized, since the api started."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        for name, doc, value in (
            (
                "ferry_prompt_segments_cached",
                "segments of long prompts found in the api's segment cache "
                "(a conversation's earlier messages: not tokenized again)",
                self.cache.hits,
            ),
            ("ferry_prompt_segments_tokenized", "segments of long prompts tokenized (new text)", self.cache.misses),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class VllmAliases:
    """Re-exports Ferry's series under vLLM's names (a collector on its own registry, reading Ferry's)."""

    def __init__(self, source: CollectorRegistry, model_name: str):
        self.source, self.model_name = source, model_name

    def collect(self):
        label = {"model_name": self.model_name}
        queries = 0.0
        success: dict[str, float] = {}
        for family in self.source.collect():
            if family.name == "ferry_prompt_tokens":
                queries = next(s.value for s in family.samples if s.name.endswith("_total"))
            if family.name == "ferry_requests":
                for s in family.samples:
                    reason = FINISHED_REASONS.get(s.labels.get("outcome", ""))
                    if s.name.endswith("_total") and reason is not None:
                        success[reason] = success.get(reason, 0.0) + s.value
            for target in VLLM_ALIASES.get(family.name, ()):
                alias = Metric(target, family.documentation + " (alias of " + family.name + ")", family.type)
                for s in family.samples:
                    if not s.name.endswith("_created"):
                        alias.add_sample(target + s.name[len(family.name) :], {**s.labels, **label}, s.value)
                yield alias
        # vLLM counts prefix-cache lookups in tokens: every prompt token is looked up
        looked_up = CounterMetricFamily(
            "vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache", labels=["model_name"]
        )
        looked_up.add_metric([self.model_name], queries)
        yield looked_up
        finished = CounterMetricFamily(
            "vllm:request_success",
            "finished requests by finish reason (alias of ferry_requests by outcome)",
            labels=["model_name", "finished_reason"],
        )
        for reason in FINISH_REASONS:
            finished.add_metric([self.model_name, reason], success.get(reason, 0.0))
        yield finished


class ApiMetrics:
    def __init__(self, model_name: str = "ferry") -> None:
        self.registry = r = CollectorRegistry()
        # a generation per choice: a request with n=3 (or three prompts) counts 3; one refused before any ran, 1
        self.requests = Counter(
            "ferry_requests",
            "finished requests by route and outcome, counted per choice: a "
            "request with n choices (or n prompts) counts n once it ran; one refused before it "
            "ran counts once",
            ["route", "outcome"],
            registry=r,
        )
        self.refused = Counter(
            "ferry_refused_requests",
            "requests answered with an error status (4xx, 5xx), by route and status",
            ["route", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("ferry_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("ferry_generation_tokens", "tokens generated", registry=r)
        self.cached_tokens = Counter(
            "ferry_prefix_cached_tokens", "prompt tokens reused from the prefix cache", registry=r
        )
        self.ttft = Histogram(
            "ferry_time_to_first_token_seconds", "request arrival to first token", buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "ferry_inter_token_latency_seconds",
            "time between consecutive tokens",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.e2e = Histogram(
            "ferry_e2e_request_latency_seconds", "request arrival to last token", buckets=_LATENCY, registry=r
        )
        self.status = StatusGauges(r, "ferry_")
        self.kv_usage = Gauge("ferry_kv_cache_usage", "fraction of KV pages held by requests (0..1)", registry=r)
        self.state_snapshots = Gauge(
            "ferry_state_snapshots", "linear-state snapshots the prefix cache holds (hybrid models)", registry=r
        )
        self.expert_hit_rate = Gauge(
            "ferry_expert_hit_rate", "expert-cache hits / lookups since the worker started", registry=r
        )
        self._status_counters = _StatusCounters()
        r.register(self._status_counters)
        self.ready = Gauge("ferry_ready", "1 when scheduler and worker are ready", registry=r)
        self.tokenizing = Gauge(
            "ferry_tokenizations_in_flight", "prompts being tokenized or waiting for the tokenizer thread", registry=r
        )
        self.tokenize_seconds = Histogram(
            "ferry_tokenization_seconds",
            "time to render and tokenize one prompt (waiting for the tokenizer thread included)",
            buckets=_LATENCY,
            registry=r,
        )
        self.tokenize_refused = Counter(
            "ferry_tokenizations_refused",
            "prompts refused before tokenizing, by reason "
            "(too_long: more characters than the model length could hold; busy: too "
            "many prompts waiting for the tokenizer)",
            ["reason"],
            registry=r,
        )
        self.http_refused = Counter(
            "ferry_http_refused",
            "connections and requests refused before they reached a "
            "route, by reason (connections: past --max-connections; header_bytes: past "
            "--max-header-size; header_timeout: headers later than --header-timeout)",
            ["reason"],
            registry=r,
        )
        self.aliases = CollectorRegistry()
        self.aliases.register(VllmAliases(r, model_name))

    def watch_segment_cache(self, cache) -> None:
        """Export the tokenizer's segment cache counters (none where the tokenizer has no cache)."""
        if cache is not None:
            self.registry.register(_SegmentCounters(cache))

    def refresh_from(self, status: SchedulerStatus | None, ready: bool) -> None:
        self.ready.set(1 if ready else 0)
        if status is None:
            return
        self.status.set_from(status)
        if status.kv_pages_total:
            self.kv_usage.set(1 - status.kv_pages_available / status.kv_pages_total)
        lookups = status.expert_hits + status.expert_misses
        self.expert_hit_rate.set(status.expert_hits / lookups if lookups else 0)
        self.state_snapshots.set(status.state_snapshots)
        for key in self._status_counters.values:
            self._status_counters.values[key] = getattr(status, key)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry) + generate_latest(self.aliases)
