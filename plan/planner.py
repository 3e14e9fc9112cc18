"""The memory planner: a device budget in, exact pool sizes out (DESIGN §2).

Pure integer arithmetic over the pools' own cost functions (`pool_layout`), so it runs and is
tested without a GPU. The worker calls `make_plan` at boot with measured free memory, measured
weight bytes and a profiled workspace; `ferry plan` calls it with estimates.

Order (rule 3): fixed costs (weights, workspace, linear-state pool) -> requirements
(--num-tokens/--num-pages, --moe-cache-size/--moe-cache-rate: exact) -> floors
(--kv-reserve-tokens, the minimum expert slots: lower bounds) -> automatic fill (expert slots
first, up to every expert; only then KV pages past their floor). If requirements and floors do not fit, we fail here,
before any allocation, with every term listed (rule 4).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

from ferry.shared.errors import ConfigError, PlanError
from ferry.plan.model_config import ModelSpec
from ferry.shared.units import format_bytes
from ferry.plan import host_memory as H
from ferry.plan import pool_layout as L

DEFAULT_MEMORY_RATIO = 0.9
DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_RUNNING_REQUESTS = 64
DEFAULT_MAX_PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class PlanRequest:
    """The planner flags as the user gave them: None means "not set" (so errors can tell)."""

    gpu_memory: int | None = None
    memory_ratio: float | None = None
    num_tokens: int | None = None
    num_pages: int | None = None
    kv_reserve_tokens: int | None = None
    moe_cache_size: int | None = None
    moe_cache_rate: float | None = None
    page_size: int | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    host_memory: int | None = None  # host RAM for the expert banks; None: what the machine has

    def is_set(self, name: str) -> bool:
        return getattr(self, name) is not None


@dataclass(frozen=True)
class Measured:
    """Facts about the device and the loaded model: measured at boot, estimated by `ferry plan`."""

    weights_bytes: int
    workspace_bytes: int
    free_bytes: int | None = None  # free device memory before loading; None: no device here
    weights_source: str = "estimate"  # measured | safetensors | shapes
    workspace_source: str = "estimate"  # profiled | estimate
    free_source: str = "measured"  # how free_bytes was obtained, for the budget's derivation
    host_available_bytes: int | None = None  # this machine's MemAvailable; None: unknown (no host check)


@dataclass(frozen=True)
class KVPlan:
    page_size: int
    pages: int
    sentinel_pages: int
    tokens: int
    bytes_per_token: int
    bytes: int


@dataclass(frozen=True)
class LinearStatePlan:
    slots: int
    padding_slots: int
    bytes_per_slot: int
    bytes: int


@dataclass(frozen=True)
class ExpertPlan:
    slots: int
    total: int
    min_slots: int
    bytes_per_slot: int
    bytes: int


@dataclass(frozen=True)
class HostPlan:
    """Host RAM: the pinned banks of the offloaded experts (0 when every expert has a GPU slot) and
    what the banks may take (--host-memory, else MemAvailable; None when unknown)."""

    expert_bank_bytes: int
    available_bytes: int | None
    available_source: str  # --host-memory | MemAvailable | unknown
    reserve_bytes: int  # kept free for the rest of the process and the OS


@dataclass(frozen=True)
class Plan:
    budget_bytes: int
    budget_derivation: str
    weights_bytes: int
    weights_source: str
    workspace_bytes: int
    workspace_source: str
    total_bytes: int
    headroom_bytes: int
    kv: KVPlan
    linear_state: LinearStatePlan
    experts: ExpertPlan
    dtype: str
    max_running_requests: int
    max_prefill_tokens: int
    max_model_len: int
    host: HostPlan

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Resolved:
    """Flags with defaults filled in, validated against the model."""

    dtype: str
    page_size: int
    max_running_requests: int
    max_prefill_tokens: int
    max_model_len: int
    memory_ratio: float


def resolve(spec: ModelSpec, req: PlanRequest) -> Resolved:
    from ferry.plan.model_config import normalize_dtype

    dtype = normalize_dtype(req.dtype) if req.dtype and req.dtype != "auto" else spec.dtype
    page_size = req.page_size if req.page_size is not None else DEFAULT_PAGE_SIZE
    max_model_len = req.max_model_len if req.max_model_len is not None else spec.max_position_embeddings
    mrr = req.max_running_requests if req.max_running_requests is not None else DEFAULT_MAX_RUNNING_REQUESTS
    mpt = req.max_prefill_tokens if req.max_prefill_tokens is not None else DEFAULT_MAX_PREFILL_TOKENS
    ratio = req.memory_ratio if req.memory_ratio is not None else DEFAULT_MEMORY_RATIO
    checks = [
        (page_size >= 1, f"--page-size must be at least 1, got {page_size}"),
        (max_model_len >= 1, f"--max-model-len must be at least 1, got {max_model_len}"),
        (mrr >= 1, f"--max-running-requests must be at least 1, got {mrr}"),
        (mpt >= 1, f"--max-prefill-tokens must be at least 1, got {mpt}"),
        (0 < ratio <= 1, f"--memory-ratio must be in (0, 1], got {ratio}"),
        (req.num_tokens is None or req.num_tokens >= 1, f"--num-tokens must be at least 1, got {req.num_tokens}"),
        (req.num_pages is None or req.num_pages >= 1, f"--num-pages must be at least 1, got {req.num_pages}"),
        (req.kv_reserve_tokens is None or req.kv_reserve_tokens >= 0,
         f"--kv-reserve-tokens must not be negative, got {req.kv_reserve_tokens}"),
        (req.moe_cache_rate is None or 0 < req.moe_cache_rate <= 1,
         f"--moe-cache-rate must be in (0, 1], got {req.moe_cache_rate}"),
        (req.gpu_memory is None or req.gpu_memory > 0, f"--gpu-memory must be positive, got {req.gpu_memory}"),
        (req.host_memory is None or req.host_memory > 0, f"--host-memory must be positive, got {req.host_memory}"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    if req.num_tokens is not None and req.num_pages is not None:
        raise ConfigError("--num-tokens and --num-pages both fix the KV pool: give only one")
    if req.moe_cache_size is not None and req.moe_cache_rate is not None:
        raise ConfigError("--moe-cache-size and --moe-cache-rate both fix the expert cache: give only one")
    if max_model_len > spec.max_position_embeddings:
        raise ConfigError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"({spec.max_position_embeddings})"
        )
    return Resolved(dtype, page_size, mrr, mpt, max_model_len, ratio)


def min_expert_slots(spec: ModelSpec) -> int:
    """Fewest slots the offload loop can run with: one MoE layer's experts all at once, so a
    step's routed experts of one layer always fit together and none is evicted by its own layer."""
    return min(spec.num_experts, spec.total_experts)


def _budget(req: PlanRequest, ratio: float, measured: Measured) -> tuple[int, str]:
    ratio_text = f"--memory-ratio {ratio:g}" if req.is_set("memory_ratio") else f"memory ratio {ratio:g} (default)"
    if req.gpu_memory is not None:
        if measured.free_bytes is not None and req.gpu_memory > measured.free_bytes:
            raise PlanError(
                f"--gpu-memory {format_bytes(req.gpu_memory)} is more than the device has free "
                f"({format_bytes(measured.free_bytes)}); the largest value that fits is {measured.free_bytes}"
            )
        base, base_text = req.gpu_memory, f"--gpu-memory {format_bytes(req.gpu_memory)}"
    elif measured.free_bytes is not None:
        base, base_text = measured.free_bytes, f"free device memory {format_bytes(measured.free_bytes)} ({measured.free_source})"
    else:
        raise ConfigError("no GPU here to measure: give the device budget with --gpu-memory (e.g. --gpu-memory 24GiB)")
    budget = math.floor(base * ratio)
    return budget, f"{base_text} x {ratio_text} = {format_bytes(budget)}"


def _largest(cost: Callable[[int], int], available: int, lo: int, hi: int) -> int | None:
    """Largest n in [lo, hi] with cost(n) <= available (cost non-decreasing); None if not even lo."""
    if cost(lo) > available:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Terms:
    """The planned terms, as labelled lines for error messages and the readable table."""

    lines: list[tuple[str, int]] = field(default_factory=list)

    def add(self, label: str, nbytes: int) -> None:
        self.lines.append((label, nbytes))

    @property
    def total(self) -> int:
        return sum(b for _, b in self.lines)

    def render(self) -> str:
        return "\n".join(f"  {label:<62} {format_bytes(b):>12}" for label, b in self.lines)


def make_plan(spec: ModelSpec, req: PlanRequest, measured: Measured) -> Plan:
    """The planner's single entry point (worker boot and `ferry plan` alike)."""
    r = resolve(spec, req)
    budget, derivation = _budget(req, r.memory_ratio, measured)

    def kv_cost(pages: int) -> int:
        return L.kv_pool_layout(spec, r.dtype, pages, r.page_size).nbytes

    def expert_cost(slots: int) -> int:
        return L.expert_slot_layout(spec, r.dtype, slots, r.max_prefill_tokens).nbytes

    has_linear = bool(spec.linear_attention_layers)
    linear_slots = r.max_running_requests if has_linear else 0
    linear_padding = L.LINEAR_PADDING_SLOTS if has_linear else 0
    linear_bytes = L.linear_state_layout(spec, r.dtype, linear_slots).nbytes

    total_experts, floor_slots = spec.total_experts, min_expert_slots(spec)

    # ---- requirements (exact) and floors (lower bounds) --------------------------------
    kv_required_pages: int | None = None
    if req.num_pages is not None:
        kv_required_pages = req.num_pages
    elif req.num_tokens is not None:
        kv_required_pages = -(-req.num_tokens // r.page_size)
    kv_floor_tokens = req.kv_reserve_tokens if req.kv_reserve_tokens is not None else r.max_model_len
    kv_floor_pages = -(-kv_floor_tokens // r.page_size)

    expert_required: int | None = None
    if req.moe_cache_size is not None:
        expert_required = req.moe_cache_size
        flag = "--moe-cache-size"
    elif req.moe_cache_rate is not None:
        expert_required = math.ceil(req.moe_cache_rate * total_experts)
        flag = "--moe-cache-rate"
    if expert_required is not None:
        if expert_required > total_experts:
            raise ConfigError(
                f"{flag} asks for {expert_required} expert slots but the model has only {total_experts} "
                f"experts ({len(spec.moe_layer_indices)} MoE layers x {spec.num_experts}); the largest value is "
                + (f"{total_experts}" if flag == "--moe-cache-size" else "1.0")
            )
        if expert_required < floor_slots:
            smallest = floor_slots if flag == "--moe-cache-size" else f"{floor_slots / total_experts:.6g}"
            raise ConfigError(
                f"{flag} gives {expert_required} expert slots, fewer than the {floor_slots} the offload loop "
                f"needs (one MoE layer's experts at once); the smallest value is {smallest}"
            )

    kv_pages = kv_required_pages if kv_required_pages is not None else kv_floor_pages
    slots = expert_required if expert_required is not None else floor_slots

    terms = _Terms()
    terms.add(f"weights, GPU-resident ({measured.weights_source})", measured.weights_bytes)
    terms.add(f"activation workspace ({measured.workspace_source}, {r.max_prefill_tokens}-token step)",
              measured.workspace_bytes)  # fmt: skip
    if has_linear:
        terms.add(f"linear-state pool: {linear_slots} slots + {linear_padding} padding", linear_bytes)
    kv_label = (
        f"KV pool: {kv_pages} pages x {r.page_size} tokens + {L.KV_SENTINEL_PAGES} sentinel page ("
        + ("--num-pages" if req.num_pages is not None else "--num-tokens" if req.num_tokens is not None
           else "--kv-reserve-tokens" if req.kv_reserve_tokens is not None
           else f"floor: one max-length sequence, max_model_len {r.max_model_len}")
        + ")"
    )  # fmt: skip
    terms.add(kv_label, kv_cost(kv_pages))
    expert_label = f"expert slots: {slots} x {format_bytes(L.expert_bytes(spec, r.dtype))} (" + (
        "--moe-cache-size" if req.moe_cache_size is not None else "--moe-cache-rate"
        if req.moe_cache_rate is not None else "floor: one MoE layer"
    ) + ")"  # fmt: skip
    terms.add(expert_label, expert_cost(slots))

    if terms.total > budget:
        raise PlanError(_explain_failure(spec, req, r, measured, budget, derivation, terms, kv_pages, slots,
                                         linear_bytes, kv_cost, expert_cost))  # fmt: skip

    # ---- automatic fill: experts first (they set decode speed), then KV ----------------
    remaining = budget - terms.total
    if expert_required is None:
        grown = _largest(lambda s: expert_cost(s) - expert_cost(slots), remaining, slots, total_experts)
        remaining -= expert_cost(grown) - expert_cost(slots)
        slots = grown
    # KV grows past its floor once the experts can take no more: every expert is resident, or
    # their count is a requirement. While experts are filled automatically, crumbs smaller than
    # one expert slot stay headroom, so a KV floor of N tokens and a requirement of N give the
    # same plan.
    if kv_required_pages is None and (expert_required is not None or slots == total_experts):
        upper = kv_pages + remaining // max(L.kv_bytes_per_token(spec, r.dtype) * r.page_size, 1) + 1
        grown = _largest(lambda p: kv_cost(p) - kv_cost(kv_pages), remaining, kv_pages, upper)
        remaining -= kv_cost(grown) - kv_cost(kv_pages)
        kv_pages = grown

    kv = KVPlan(
        page_size=r.page_size,
        pages=kv_pages,
        sentinel_pages=L.KV_SENTINEL_PAGES,
        tokens=kv_pages * r.page_size,
        bytes_per_token=L.kv_bytes_per_token(spec, r.dtype),
        bytes=kv_cost(kv_pages),
    )
    linear = LinearStatePlan(linear_slots, linear_padding, L.linear_state_bytes_per_slot(spec, r.dtype), linear_bytes)
    experts = ExpertPlan(slots, total_experts, floor_slots, L.expert_bytes(spec, r.dtype), expert_cost(slots))
    total = measured.weights_bytes + measured.workspace_bytes + kv.bytes + linear.bytes + experts.bytes
    assert total <= budget, "planner arithmetic broke its own invariant"
    host = _host_plan(spec, req, r.dtype, measured, offloaded=slots < total_experts)
    return Plan(
        budget_bytes=budget,
        budget_derivation=derivation,
        weights_bytes=measured.weights_bytes,
        weights_source=measured.weights_source,
        workspace_bytes=measured.workspace_bytes,
        workspace_source=measured.workspace_source,
        total_bytes=total,
        headroom_bytes=budget - total,
        kv=kv,
        linear_state=linear,
        experts=experts,
        dtype=r.dtype,
        max_running_requests=r.max_running_requests,
        max_prefill_tokens=r.max_prefill_tokens,
        max_model_len=r.max_model_len,
        host=host,
    )


def _host_plan(spec: ModelSpec, req: PlanRequest, dtype: str, measured: Measured, offloaded: bool) -> HostPlan:
    """The banks' host RAM, checked against what the machine (or --host-memory) has: an offload
    plan whose banks cannot fit is a plan error, before anything is allocated (rule 4)."""
    if req.host_memory is not None:
        available, source = req.host_memory, "--host-memory"
    elif measured.host_available_bytes is not None:
        available, source = measured.host_available_bytes, "MemAvailable"
    else:
        available, source = None, "unknown"
    banks = H.expert_bank_bytes(spec, dtype) if offloaded else 0
    host = HostPlan(banks, available, source, H.HOST_RESERVE_BYTES)
    if banks and available is not None and banks + H.HOST_RESERVE_BYTES > available:
        where = (f"--host-memory {format_bytes(available)}" if source == "--host-memory"
                 else f"this machine has {format_bytes(available)} available (MemAvailable)")  # fmt: skip
        raise PlanError(
            f"the offloaded experts do not fit in host RAM: their pinned banks need {format_bytes(banks)} "
            f"({len(spec.moe_layer_indices)} MoE layers x {spec.num_experts} experts x "
            f"{L.expert_bytes(spec, dtype):,} B) plus {format_bytes(H.HOST_RESERVE_BYTES)} kept for the rest of the "
            f"process, but {where}.\n"
            f"the banks need a host with at least {format_bytes(banks + H.HOST_RESERVE_BYTES)} available"
            + ("; to plan for another machine, give its RAM with --host-memory (e.g. --host-memory 64GiB)"
               if source == "MemAvailable" else "")
        )  # fmt: skip
    return host


def _explain_failure(spec, req, r, measured, budget, derivation, terms, kv_pages, slots, linear_bytes,
                     kv_cost, expert_cost) -> str:  # fmt: skip
    """Rule 4: every term, how the budget was derived, and for each flag the user set that
    sizes a term, the largest value that would fit with everything else unchanged."""
    over = terms.total - budget
    lines = [
        f"the memory plan does not fit: it needs {format_bytes(terms.total)} but the budget is "
        f"{format_bytes(budget)} ({format_bytes(over)} over).",
        f"budget: {derivation}",
        "terms:",
        terms.render(),
        f"  {'total':<62} {format_bytes(terms.total):>12}",
    ]
    others_kv = terms.total - kv_cost(kv_pages)
    others_experts = terms.total - expert_cost(slots)
    hints = []

    def pages_fitting() -> int | None:
        upper = max(kv_pages, 1)
        return _largest(kv_cost, budget - others_kv, 0, upper)

    if req.num_tokens is not None or req.num_pages is not None or req.kv_reserve_tokens is not None:
        pages = pages_fitting()
        usable = pages if pages is not None else 0
        if req.num_pages is not None:
            hints.append(_hint("--num-pages", usable, 1))
        elif req.num_tokens is not None:
            hints.append(_hint("--num-tokens", usable * r.page_size, 1))
        else:
            hints.append(_hint("--kv-reserve-tokens", usable * r.page_size, 0))
    if req.moe_cache_size is not None or req.moe_cache_rate is not None:
        s = _largest(expert_cost, budget - others_experts, 0, slots) or 0
        floor = min_expert_slots(spec)
        if req.moe_cache_size is not None:
            hints.append(_hint("--moe-cache-size", s, floor))
        else:
            rate = math.floor(s / spec.total_experts * 1e6) / 1e6
            while rate > 0 and math.ceil(rate * spec.total_experts) > s:
                rate -= 1e-6
            hints.append(_hint("--moe-cache-rate", rate if s >= floor else 0, floor / spec.total_experts))
    if req.max_running_requests is not None and spec.linear_attention_layers:
        def linear(n: int) -> int:
            return L.linear_state_layout(spec, r.dtype, n).nbytes
        n = _largest(linear, budget - (terms.total - linear_bytes), 0, r.max_running_requests) or 0
        hints.append(_hint("--max-running-requests", n, 1))
    if req.max_model_len is not None and req.kv_reserve_tokens is None and kv_pages and \
            req.num_tokens is None and req.num_pages is None:  # fmt: skip
        pages = pages_fitting() or 0
        hints.append(_hint("--max-model-len", pages * r.page_size, 1))
    if req.gpu_memory is not None:
        need = math.ceil(terms.total / r.memory_ratio)
        while math.floor(need * r.memory_ratio) < terms.total:
            need += 1
        hints.append(f"--gpu-memory would have to be at least {need} bytes ({format_bytes(need)})")
    if req.memory_ratio is not None:
        base = req.gpu_memory if req.gpu_memory is not None else measured.free_bytes
        needed_ratio = math.ceil(terms.total / base * 1e4) / 1e4
        hints.append(f"--memory-ratio would have to be at least {needed_ratio:g}" if needed_ratio <= 1 else
                     "--memory-ratio: no value up to 1 fits")  # fmt: skip
    if hints:
        lines.append("to fit, with everything else unchanged:")
        lines.extend(f"  {h}" for h in hints)
    else:
        lines.append(
            "every term above comes from defaults and the model itself; the KV floor defaults to one sequence of "
            "max_model_len tokens, and the expert floor is one MoE layer's experts"
        )
    return "\n".join(lines)


def _hint(flag: str, largest: float, smallest_meaningful: float) -> str:
    if largest < smallest_meaningful or largest <= 0:
        return f"{flag}: no value fits; the other terms alone leave too little of the budget"
    return f"{flag}: the largest value that fits is {largest:g}" if isinstance(largest, float) else \
        f"{flag}: the largest value that fits is {largest}"  # fmt: skip
