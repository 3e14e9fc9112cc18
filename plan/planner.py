"""The memory planner: a device budget in, exact pool sizes out (docs/ARCHITECTURE.md §2).

Pure integer arithmetic over the pools' own cost functions (`pool_layout`), so it runs and is
tested without a GPU. The worker calls `make_plan` at boot with measured free memory, measured
weight bytes and a profiled workspace; `ferry plan` calls it with estimates.

Order (rule 3): fixed costs (weights, workspace, linear-state pool and its snapshots) -> requirements
(--num-tokens/--num-pages, --moe-cache-size/--moe-cache-rate: exact) -> floors
(--kv-reserve-tokens, the minimum expert slots: lower bounds) -> automatic fill (expert slots
first, up to every expert; only then KV pages past their floor). If requirements and floors do not fit, we fail here,
before any allocation, with every term listed (rule 4).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Callable

from ferry.plan import expert_formats as F
from ferry.plan import host_memory as H
from ferry.plan import pool_layout as L
from ferry.plan.dtypes import normalize_dtype
from ferry.plan.expert_backend import (
    ExpertBackendPlan,
    check_expert_backend_flags,
    chosen_host_cpus,
    host_compute_refusal,
    parse_cpu_list,
    physical_cores,
    plan_expert_backend,
)
from ferry.plan.kv_groups import kv_groups, sliding_slice_tokens
from ferry.plan.model_config import ModelSpec
from ferry.plan.mtp_layer import mtp_resident_bytes
from ferry.plan.outside_memory import OutsideMemory, allocator_headroom
from ferry.shared.errors import ConfigError, PlanError
from ferry.shared.units import ceil_div, format_bytes

# The whole --gpu-memory (or free memory) goes to the plan, less what is measured to live outside it
# (plan/outside_memory.py): a fixed tenth left a 24 GiB card's 2.4 GiB idle, ~1,400 NVFP4 expert slots.
DEFAULT_MEMORY_RATIO = 1.0
DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_RUNNING_REQUESTS = 64
DEFAULT_MAX_PREFILL_TOKENS = 8192
# Linear-state snapshots (the prefix cache of hybrid models) when --linear-state-snapshots is not given: two
# per request that may run, so that every running conversation can keep both its prompt's end and its
# output's last page boundary (where its next turn resumes) while shared prefixes and long prefills' chunk
# ends hold the rest (docs/ARCHITECTURE.md §1, "Prefix cache"); but at most a sixteenth of the budget, since
# on a small GPU the same bytes are expert slots, which set decode speed (Qwen3.6-35B-A3B: 61.4 MiB a
# snapshot, 122 on a 141 GB card, 22 in 24 GiB). A default that does not fit beside the floors shrinks (to 0 at
# worst: no prefix reuse); an explicit count is a requirement.
DEFAULT_SNAPSHOTS_PER_RUNNING_REQUEST = 2
# Where the defaults are a single user's (plan/memory_defaults.py: experts offloaded), one a running request:
# the deepest point of each conversation, where its next turn resumes; a second is 61 MiB of slots less.
OFFLOADED_SNAPSHOTS_PER_RUNNING_REQUEST = 1
DEFAULT_SNAPSHOT_BUDGET_SHARE = 16  # the default takes at most budget / this


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
    expert_bank_format: str | None = None  # packed | plain | auto (None: auto, packed for bf16)
    linear_state_snapshots: int | None = None  # hybrid models' prefix-cache states; None: the default (above)
    expert_backend: str | None = None  # auto | gpu | hybrid | cpu (plan/expert_backend.py); None: auto
    host_expert_threads: int | None = None  # the host's expert threads; None: the cores the processes leave
    host_expert_cpus: str | None = None  # where they are pinned: auto | none | a CPU list; None: auto
    kv_cache_dtype: str | None = None  # auto | fp8 (pool_layout.KV_CACHE_DTYPES); None: auto, the model dtype
    # off | ngram | mtp (shared/speculation.py); mtp: the spec the plan is made for holds the MTP layers' K/V
    # (plan/mtp_layer.py's drafting_spec) and the weights measured hold their weights. None: off
    speculative_method: str | None = None
    # --speculative-tokens K: drafts a row carries at most (the worker's verify and chain graphs' shapes, measured as
    # the decode graphs' workspace). None: shared/speculation.py's default
    speculative_tokens: int | None = None
    # not a flag: the snapshots a running request gets by default (None: DEFAULT_SNAPSHOTS_PER_RUNNING_REQUEST);
    # plan/memory_defaults.py sets it where experts are offloaded
    snapshots_per_running_request: int | None = None

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
    host_cores: int | None = None  # physical cores for the host's expert threads; None: this machine's
    # device memory outside the allocator the budget leaves room for (CUDA context, kernels); none on CPU
    outside: OutsideMemory = OutsideMemory()


@dataclass(frozen=True)
class KVGroupPlan:
    """One KV group (plan/kv_groups.py): its layers' shape, and how its tensor is kept: paged over the context
    (ring_pages 0: `pages` = the context's pages + sentinel) or in rings (`pages` = (ring_slots + 1) x
    ring_pages). `bytes`: its tensors' bytes (the pool's alignment is the KV plan's)."""

    layers: tuple[int, ...]
    kv_heads: int
    head_dim: int
    window: int  # 0: full attention
    ring_pages: int
    pages: int
    bytes_per_token: int
    bytes: int


@dataclass(frozen=True)
class KVPlan:
    page_size: int
    pages: int  # the context's usable pages: the scheduler's page ids, which the groups paged over it share
    sentinel_pages: int
    tokens: int  # pages x page_size: the context the pool holds
    bytes_per_token: int  # of context: the groups paged over it (values and, with fp8, their scales)
    bytes: int
    cache_dtype: str = "auto"  # --kv-cache-dtype: auto (the model dtype) | fp8
    value_dtype: str = ""  # the element type of K and V in the pool: the model dtype, or float8_e4m3fn
    scale_bytes_per_token: int = 0  # the fp8 scales' part of bytes_per_token (0 with auto)
    groups: tuple[KVGroupPlan, ...] = ()
    # request slots the sliding groups' rings are for (ids 1..ring_slots, 0 the padding rows'), each ring
    # room for a sliding slice of ring_slice_tokens new tokens (kv_groups.sliding_slice_tokens); 0: no ring
    ring_slots: int = 0
    ring_slice_tokens: int = 0


@dataclass(frozen=True)
class LinearStatePlan:
    slots: int
    padding_slots: int
    bytes_per_slot: int
    bytes: int


@dataclass(frozen=True)
class LinearSnapshotPlan:
    """The linear-state snapshots of hybrid models (plan/pool_layout.py's linear_state_snapshot_layout):
    each the whole Gated DeltaNet state of one sequence at a cached prefix's end. 0 without linear
    attention, or when hybrid prefix reuse is off (--linear-state-snapshots 0)."""

    snapshots: int = 0
    bytes_per_snapshot: int = 0
    bytes: int = 0
    source: str = ""  # how the count was chosen: --linear-state-snapshots, or the default (and whether it shrank)


@dataclass(frozen=True)
class ExpertPlan:
    slots: int
    total: int
    min_slots: int
    bytes_per_slot: int
    bytes: int
    format: str = F.BF16  # the expert format's name (plan/expert_formats: F.expert_format_name)
    # the rest of `bytes`, named (pool_layout.expert_pool_parts):
    # slots x bytes_per_slot + staging_bytes + cache_state_bytes + padding_bytes == bytes
    staging_slots: int = 0  # the prefill's staging slots, outside the cache (offload only)
    staging_bytes: int = 0
    cache_state_bytes: int = 0  # the device-side expert cache's state (offload only)
    padding_bytes: int = 0  # alignment: views on VIEW_ALIGN, the pool rounded to POOL_ALIGN
    # a format whose rows differ by MoE layer (gguf-mixed): per family (w13, w2), the MoE layers of each row type,
    # and the bytes of every routed expert's rows left unused by the layers whose rows are smaller than the slot's
    # (the host banks, laid out as the slots, hold exactly that much padding); {} and 0 otherwise
    row_types: dict[str, dict[str, int]] = field(default_factory=dict)
    row_padding_bytes: int = 0


@dataclass(frozen=True)
class HostPlan:
    """Host RAM: the pinned banks of the offloaded experts (0 when every expert has a GPU slot) and
    what the banks may take (--host-memory, else MemAvailable; None when unknown)."""

    expert_bank_bytes: int
    expert_bank_format: str  # the banks' --expert-bank-format word: packed (12 bits a value) | plain (as the slots)
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
    linear_state_snapshots: LinearSnapshotPlan = LinearSnapshotPlan()
    # how max_prefill_tokens was set: --max-prefill-tokens, or chosen from memory (plan/prefill_chunk.py)
    max_prefill_tokens_source: str = "default"
    # who computes missed experts, and on how many host threads (plan/expert_backend.py)
    expert_backend: ExpertBackendPlan = ExpertBackendPlan()
    # how max_running_requests and max_model_len were set when a flag did not (plan/memory_defaults.py)
    sizing_source: str = ""

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
    kv_cache_dtype: str = "auto"  # auto | fp8


def resolve(spec: ModelSpec, req: PlanRequest) -> Resolved:
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
        (
            req.kv_reserve_tokens is None or req.kv_reserve_tokens >= 0,
            f"--kv-reserve-tokens must not be negative, got {req.kv_reserve_tokens}",
        ),
        (
            req.moe_cache_rate is None or 0 < req.moe_cache_rate <= 1,
            f"--moe-cache-rate must be in (0, 1], got {req.moe_cache_rate}",
        ),
        (req.gpu_memory is None or req.gpu_memory > 0, f"--gpu-memory must be positive, got {req.gpu_memory}"),
        (req.host_memory is None or req.host_memory > 0, f"--host-memory must be positive, got {req.host_memory}"),
        (
            req.linear_state_snapshots is None or req.linear_state_snapshots >= 0,
            f"--linear-state-snapshots must not be negative, got {req.linear_state_snapshots}",
        ),
    ]
    kv_cache_dtype = req.kv_cache_dtype if req.kv_cache_dtype is not None else "auto"
    checks.append(
        (
            kv_cache_dtype in L.KV_CACHE_DTYPES,
            f"--kv-cache-dtype must be one of {', '.join(L.KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}",
        )
    )
    check_expert_backend_flags(req.expert_backend, req.host_expert_threads)
    if req.host_expert_cpus not in (None, "auto", "none"):  # a bad list fails the plan before any weight loads
        parse_cpu_list(req.host_expert_cpus)
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
    return Resolved(dtype, page_size, mrr, mpt, max_model_len, ratio, kv_cache_dtype)


def plan_budget(spec: ModelSpec, req: PlanRequest, measured: Measured) -> int:
    """The bytes the plan's terms may take under `req` and `measured` (ConfigError/PlanError as make_plan)."""
    return _budget(req, resolve(spec, req).memory_ratio, measured)[0]


def min_expert_slots(spec: ModelSpec) -> int:
    """Fewest slots the offload loop can run with: one MoE layer's experts all at once, so a
    step's routed experts of one layer always fit together and none is evicted by its own layer."""
    return min(spec.num_experts, spec.total_experts)


def _budget(req: PlanRequest, ratio: float, measured: Measured) -> tuple[int, str]:
    """The bytes the plan's terms may take: --gpu-memory (the whole process) or the free memory, times the
    ratio, less what lives outside the allocator and, under the default ratio, the allocator's headroom."""
    ratio_text = f"--memory-ratio {ratio:g}" if req.is_set("memory_ratio") else f"memory ratio {ratio:g} (default)"
    outside = measured.outside
    if req.gpu_memory is not None:
        if measured.free_bytes is not None and req.gpu_memory - outside.held > measured.free_bytes:
            largest = measured.free_bytes + outside.held
            raise PlanError(
                f"--gpu-memory {format_bytes(req.gpu_memory)} is more than the device has free "
                f"({format_bytes(measured.free_bytes)} besides the {format_bytes(outside.held)} this process holds "
                f"outside the allocator); the largest value that fits is {largest} ({format_bytes(largest)})"
            )
        base, base_text = req.gpu_memory, f"--gpu-memory {format_bytes(req.gpu_memory)}"
    elif measured.free_bytes is not None:
        base, base_text = (
            measured.free_bytes,
            f"free device memory {format_bytes(measured.free_bytes)} ({measured.free_source})",
        )
    else:
        raise ConfigError("no GPU here to measure: give the device budget with --gpu-memory (e.g. --gpu-memory 24GiB)")
    budget = budget_for_base(base, ratio, outside, req.is_set("memory_ratio"))
    text = f"{base_text} x {ratio_text}"
    if outside.bytes:
        text += f" - {outside.describe()}"
    headroom = _headroom(base, outside, req.is_set("memory_ratio"))
    if headroom:
        text += (
            f" - {format_bytes(headroom)} allocator headroom (1% of it, at least {format_bytes(allocator_headroom(0))})"
        )
    return budget, f"{text} = {format_bytes(budget)}"


def _headroom(base: int, outside: OutsideMemory, ratio_given: bool) -> int:
    """The allocator's headroom: on a CUDA worker (one with memory outside the allocator) under the default
    ratio; an explicit --memory-ratio sets its own share aside instead."""
    return allocator_headroom(base) if outside.source and not ratio_given else 0


def budget_for_base(base: int, ratio: float, outside: OutsideMemory, ratio_given: bool) -> int:
    """The plan's budget from a device budget `base` (--gpu-memory or free memory)."""
    return max(0, math.floor(base * ratio) - outside.bytes - _headroom(base, outside, ratio_given))


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


@dataclass(frozen=True)
class _Costs:
    """What each pool costs at a given count, by `pool_layout`'s functions: the one cost model."""

    spec: ModelSpec
    r: Resolved

    def kv(self, pages: int) -> int:
        return self.kv_layout(pages).nbytes

    def kv_layout(self, pages: int) -> L.PoolLayout:
        """The KV pool at `pages` context pages, the sliding groups in rings for the running requests where
        rings are smaller (plan/kv_groups.py)."""
        r = self.r
        slice_tokens = sliding_slice_tokens(r.max_prefill_tokens)
        return L.kv_pool_layout(
            self.spec, r.dtype, pages, r.page_size, r.kv_cache_dtype, r.max_running_requests, slice_tokens
        )

    def kv_groups(self, pages: int) -> tuple[L.KvGroupLayout, ...]:
        r = self.r
        slice_tokens = sliding_slice_tokens(r.max_prefill_tokens)
        return L.kv_group_layouts(self.spec, pages, r.page_size, r.max_running_requests, slice_tokens)

    def experts(self, slots: int) -> int:
        return L.expert_slot_layout(self.spec, self.r.dtype, slots, self.r.max_prefill_tokens).nbytes

    def linear_state(self, slots: int) -> int:
        return L.linear_state_layout(self.spec, self.r.dtype, slots).nbytes

    def snapshots(self, snapshots: int) -> int:
        return L.linear_state_snapshot_layout(self.spec, self.r.dtype, snapshots).nbytes


@dataclass
class _Sizes:
    """The pools' sizes as the plan is made: requirements, or floors until the automatic fill."""

    kv_pages: int
    kv_required: bool  # --num-tokens / --num-pages fixed kv_pages
    expert_slots: int
    experts_required: bool  # --moe-cache-size / --moe-cache-rate fixed expert_slots
    linear_slots: int  # max_running_requests for a model with linear attention, else 0
    snapshots: int = 0  # linear-state snapshots (hybrid models)
    snapshots_required: bool = False  # --linear-state-snapshots fixed them
    snapshots_capped: bool = False  # the default was more than its share of the budget
    snapshots_shrunk: bool = False  # the default did not fit beside the floors and gave way


def make_plan(spec: ModelSpec, req: PlanRequest, measured: Measured) -> Plan:
    """The planner's single entry point (worker boot and `ferry plan` alike): fixed costs, then
    requirements and floors (or a PlanError listing every term), then the automatic fill, then the
    host RAM the offloaded experts' banks take (a PlanError when they cannot fit)."""
    r = resolve(spec, req)
    budget, derivation = _budget(req, r.memory_ratio, measured)
    costs = _Costs(spec, r)
    sizes = _requirements_and_floors(spec, req, r)
    if sizes.snapshots and not sizes.snapshots_required:
        share = _largest(costs.snapshots, budget // DEFAULT_SNAPSHOT_BUDGET_SHARE, 0, sizes.snapshots) or 0
        sizes.snapshots_capped = share < sizes.snapshots
        sizes.snapshots = share
    terms = _terms(spec, req, r, measured, sizes, costs)
    if terms.total > budget and sizes.snapshots and not sizes.snapshots_required:
        # the default snapshot count never fails a plan that fits without it: it takes what is left
        room = budget - (terms.total - costs.snapshots(sizes.snapshots))
        sizes.snapshots = _largest(costs.snapshots, room, 0, sizes.snapshots) or 0
        sizes.snapshots_shrunk = True
        terms = _terms(spec, req, r, measured, sizes, costs)
    if terms.total > budget:
        raise PlanError(_explain_failure(_Failure(spec, req, r, measured, budget, derivation, terms, sizes, costs)))
    _fill(spec, sizes, costs, budget - terms.total)
    host = _host_plan(spec, req, r.dtype, measured, offloaded=sizes.expert_slots < spec.total_experts)
    plan = _plan(spec, req, r, measured, budget, derivation, sizes, costs, host)
    cores = measured.host_cores if measured.host_cores is not None else physical_cores()
    offloaded = sizes.expert_slots < spec.total_experts
    backend = plan_expert_backend(
        req.expert_backend, req.host_expert_threads, offloaded, cores, host_compute_refusal(spec)
    )
    if backend.host_threads:  # chosen here, so `ferry plan` shows them
        backend = dataclasses.replace(
            backend, host_cpus=tuple(chosen_host_cpus(backend.host_threads, req.host_expert_cpus))
        )
    return dataclasses.replace(plan, expert_backend=backend)


def _requirements_and_floors(spec: ModelSpec, req: PlanRequest, r: Resolved) -> _Sizes:
    """Exact sizes where a flag requires one, floors elsewhere; an expert requirement outside
    [one MoE layer, every expert] is a ConfigError."""
    if req.num_pages is not None:
        kv_pages = req.num_pages
    elif req.num_tokens is not None:
        kv_pages = ceil_div(req.num_tokens, r.page_size)
    else:
        kv_floor_tokens = req.kv_reserve_tokens if req.kv_reserve_tokens is not None else r.max_model_len
        kv_pages = ceil_div(kv_floor_tokens, r.page_size)
    total_experts, floor_slots = spec.total_experts, min_expert_slots(spec)
    expert_required: int | None = None
    if req.moe_cache_size is not None:
        expert_required, flag = req.moe_cache_size, "--moe-cache-size"
    elif req.moe_cache_rate is not None:
        expert_required, flag = math.ceil(req.moe_cache_rate * total_experts), "--moe-cache-rate"
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
    snapshots = 0
    if spec.linear_attention_layers:
        snapshots = (
            req.linear_state_snapshots
            if req.linear_state_snapshots is not None
            else _snapshots_per_request(req) * r.max_running_requests
        )
    return _Sizes(
        kv_pages=kv_pages,
        kv_required=req.num_pages is not None or req.num_tokens is not None,
        expert_slots=expert_required if expert_required is not None else floor_slots,
        experts_required=expert_required is not None,
        linear_slots=r.max_running_requests if spec.linear_attention_layers else 0,
        snapshots=snapshots,
        snapshots_required=req.linear_state_snapshots is not None,
    )


def _snapshots_per_request(req: PlanRequest) -> int:
    if req.snapshots_per_running_request is None:
        return DEFAULT_SNAPSHOTS_PER_RUNNING_REQUEST
    return req.snapshots_per_running_request


def _snapshot_source(sizes: _Sizes, req: PlanRequest) -> str:
    if sizes.snapshots_required:
        return "--linear-state-snapshots"
    return (
        f"default: {_snapshots_per_request(req)} x max_running_requests"
        + (f", capped at 1/{DEFAULT_SNAPSHOT_BUDGET_SHARE} of the budget" if sizes.snapshots_capped else "")
        + (", fewer to fit beside the floors" if sizes.snapshots_shrunk else "")
    )


def _terms(spec: ModelSpec, req: PlanRequest, r: Resolved, measured: Measured, sizes: _Sizes, costs: _Costs) -> _Terms:
    """Fixed costs, then the KV pool and the expert slots at their requirement or floor, labelled."""
    terms = _Terms()
    terms.add(f"weights, GPU-resident ({measured.weights_source})", measured.weights_bytes)
    terms.add(
        f"activation workspace ({measured.workspace_source}, {r.max_prefill_tokens}-token step)",
        measured.workspace_bytes,
    )
    if spec.linear_attention_layers:
        terms.add(
            f"linear-state pool: {sizes.linear_slots} slots + {L.LINEAR_PADDING_SLOTS} padding",
            costs.linear_state(sizes.linear_slots),
        )
    if sizes.snapshots:
        terms.add(
            f"linear-state snapshots: {sizes.snapshots} ({_snapshot_source(sizes, req)})",
            costs.snapshots(sizes.snapshots),
        )
    kv_label = (
        f"KV pool: {sizes.kv_pages} pages x {r.page_size} tokens + {L.KV_SENTINEL_PAGES} sentinel page"
        + (", fp8 + scales" if r.kv_cache_dtype == "fp8" else "")
        + "".join(
            f", window {g.group.window}: {r.max_running_requests} + 1 rings x {g.ring_pages} pages"
            for g in costs.kv_groups(sizes.kv_pages)
            if g.ring_pages
        )
        + " ("
        + (
            "--num-pages"
            if req.num_pages is not None
            else "--num-tokens"
            if req.num_tokens is not None
            else "--kv-reserve-tokens"
            if req.kv_reserve_tokens is not None
            else f"floor: one max-length sequence, max_model_len {r.max_model_len}"
        )
        + ")"
    )
    terms.add(kv_label, costs.kv(sizes.kv_pages))
    expert_label = (
        f"expert slots: {sizes.expert_slots} x {format_bytes(L.expert_bytes(spec, r.dtype))} ("
        + (
            "--moe-cache-size"
            if req.moe_cache_size is not None
            else "--moe-cache-rate"
            if req.moe_cache_rate is not None
            else "floor: one MoE layer"
        )
        + ")"
        + (
            f" + {L.prefill_staging_slots(spec, r.dtype)} prefill staging slots"
            if sizes.expert_slots < spec.total_experts
            else ""
        )
    )
    terms.add(expert_label, costs.experts(sizes.expert_slots))
    return terms


def _fill(spec: ModelSpec, sizes: _Sizes, costs: _Costs, remaining: int) -> None:
    """The automatic fill of what remains: experts first (they set decode speed), then KV."""
    total_experts = spec.total_experts
    if not sizes.experts_required:
        slots = sizes.expert_slots
        # every expert resident drops the cache's state and staging slots: cheaper than one slot fewer,
        # so it is tried first (the search below needs a cost that grows with the slots)
        if costs.experts(total_experts) - costs.experts(slots) <= remaining:
            grown = total_experts
        else:
            grown = _largest(lambda s: costs.experts(s) - costs.experts(slots), remaining, slots, total_experts - 1)
        remaining -= costs.experts(grown) - costs.experts(slots)
        sizes.expert_slots = grown
    # KV grows past its floor once the experts can take no more: every expert is resident, or
    # their count is a requirement. While experts are filled automatically, crumbs smaller than
    # one expert slot stay headroom, so a KV floor of N tokens and a requirement of N give the
    # same plan.
    if not sizes.kv_required and (sizes.experts_required or sizes.expert_slots == total_experts):
        pages, r = sizes.kv_pages, costs.r
        # a page costs at least the full groups' bytes (sliding ones may be rings, which stop growing); with no
        # full group, pages past every running request at max_model_len are of no use
        full = [g for g in kv_groups(spec) if not g.sliding]
        page_bytes = sum(L.kv_group_bytes_per_token(g, r.dtype, r.kv_cache_dtype) for g in full) * r.page_size
        if page_bytes:
            upper = pages + remaining // page_bytes + 1
        else:
            upper = max(pages, ceil_div(r.max_running_requests * r.max_model_len, r.page_size))
        sizes.kv_pages = _largest(lambda p: costs.kv(p) - costs.kv(pages), remaining, pages, upper)


def _kv_plan(costs: _Costs, pages: int) -> KVPlan:
    r = costs.r
    layout = costs.kv_layout(pages)
    by_name = {t.name: t.nbytes for t in layout.tensors}
    groups = tuple(
        KVGroupPlan(
            layers=g.group.layers,
            kv_heads=g.group.kv_heads,
            head_dim=g.group.head_dim,
            window=g.group.window,
            ring_pages=g.ring_pages,
            pages=g.pages,
            bytes_per_token=L.kv_group_bytes_per_token(g.group, r.dtype, r.kv_cache_dtype),
            bytes=by_name[g.name] + by_name.get(g.scale_name, 0),
        )
        for g in costs.kv_groups(pages)
    )
    context = [g for g in groups if not g.ring_pages]
    scale = L.ELEMENT_BYTES[L.KV_SCALE_DTYPE] if r.kv_cache_dtype == "fp8" else 0
    rings = any(g.ring_pages for g in groups)
    return KVPlan(
        page_size=r.page_size,
        pages=pages,
        sentinel_pages=L.KV_SENTINEL_PAGES,
        tokens=pages * r.page_size,
        bytes_per_token=sum(g.bytes_per_token for g in context),
        bytes=layout.nbytes,
        cache_dtype=r.kv_cache_dtype,
        value_dtype=L.KV_FP8_DTYPE if r.kv_cache_dtype == "fp8" else r.dtype,
        scale_bytes_per_token=sum(len(g.layers) * 2 * g.kv_heads * scale for g in context),
        groups=groups,
        ring_slots=r.max_running_requests if rings else 0,
        ring_slice_tokens=sliding_slice_tokens(r.max_prefill_tokens) if rings else 0,
    )


def _plan(
    spec: ModelSpec,
    req: PlanRequest,
    r: Resolved,
    measured: Measured,
    budget: int,
    derivation: str,
    sizes: _Sizes,
    costs: _Costs,
    host: HostPlan,
) -> Plan:
    kv = _kv_plan(costs, sizes.kv_pages)
    linear = LinearStatePlan(
        sizes.linear_slots,
        L.LINEAR_PADDING_SLOTS if spec.linear_attention_layers else 0,
        L.linear_state_bytes_per_slot(spec, r.dtype),
        costs.linear_state(sizes.linear_slots),
    )
    parts = L.expert_pool_parts(spec, r.dtype, sizes.expert_slots, r.max_prefill_tokens)
    experts = ExpertPlan(
        sizes.expert_slots,
        spec.total_experts,
        min_expert_slots(spec),
        L.expert_bytes(spec, r.dtype),
        costs.experts(sizes.expert_slots),
        F.expert_format_name(spec, host.expert_bank_format if host.expert_bank_bytes else None, r.dtype),
        parts.staging_slots,
        parts.staging_bytes,
        parts.cache_state_bytes,
        parts.padding_bytes,
        F.format_of(spec).row_types(spec),
        F.format_of(spec).row_padding_bytes(spec),
    )
    snapshots = LinearSnapshotPlan(
        sizes.snapshots,
        L.linear_state_bytes_per_slot(spec, r.dtype) if sizes.snapshots else 0,
        costs.snapshots(sizes.snapshots),
        _snapshot_source(sizes, req) if spec.linear_attention_layers else "",
    )
    total = (
        measured.weights_bytes + measured.workspace_bytes + kv.bytes + linear.bytes + snapshots.bytes + experts.bytes
    )
    assert total <= budget, "planner arithmetic broke its own invariant"
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
        linear_state_snapshots=snapshots,
    )


# ---- host RAM: the offloaded experts' pinned banks ----------------------------------------


def _host_plan(spec: ModelSpec, req: PlanRequest, dtype: str, measured: Measured, offloaded: bool) -> HostPlan:
    """The banks' host RAM, checked against what the machine (or --host-memory) has: an offload
    plan whose banks cannot fit is a plan error, before anything is allocated (rule 4)."""
    if req.host_memory is not None:
        available, source = req.host_memory, "--host-memory"
    elif measured.host_available_bytes is not None:
        available, source = measured.host_available_bytes, "MemAvailable"
    else:
        available, source = None, "unknown"
    try:
        fmt = H.bank_format(req.expert_bank_format, dtype, F.slot_format(spec), spec.expert_bias)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    banks = H.expert_bank_bytes(spec, dtype, fmt) if offloaded else 0
    host = HostPlan(banks, fmt, available, source, H.HOST_RESERVE_BYTES)
    if banks and available is not None and banks + H.HOST_RESERVE_BYTES > available:
        where = (
            f"--host-memory {format_bytes(available)}"
            if source == "--host-memory"
            else f"this machine has {format_bytes(available)} available (MemAvailable)"
        )
        raise PlanError(
            f"the offloaded experts do not fit in host RAM: their pinned banks need {format_bytes(banks)} "
            f"({len(spec.moe_layer_indices)} MoE layers x {spec.num_experts} experts, {fmt}) "
            f"plus {format_bytes(H.HOST_RESERVE_BYTES)} kept for the rest of the "
            f"process, but {where}.\n"
            f"the banks need a host with at least {format_bytes(banks + H.HOST_RESERVE_BYTES)} available"
            + (
                "; to plan for another machine, give its RAM with --host-memory (e.g. --host-memory 64GiB)"
                if source == "MemAvailable"
                else ""
            )
        )
    return host


# ---- rule 4: a plan that does not fit ----------------------------------------------------


@dataclass(frozen=True)
class _Failure:
    """Everything a failed plan's message is made from."""

    spec: ModelSpec
    req: PlanRequest
    r: Resolved
    measured: Measured
    budget: int
    derivation: str
    terms: _Terms
    sizes: _Sizes
    costs: _Costs

    def room_for(self, cost: Callable[[int], int], count: int) -> int:
        """The bytes a term costing cost(count) could take, with every other term unchanged."""
        return self.budget - (self.terms.total - cost(count))


def _explain_failure(f: _Failure) -> str:
    """Every term, how the budget was derived, and for each flag the user set that sizes a term,
    the largest value that would fit with everything else unchanged."""
    lines = [
        f"the memory plan does not fit: it needs {format_bytes(f.terms.total)} but the budget is "
        f"{format_bytes(f.budget)} ({format_bytes(f.terms.total - f.budget)} over).",
        f"budget: {f.derivation}",
        "terms:",
        f.terms.render(),
        f"  {'total':<62} {format_bytes(f.terms.total):>12}",
    ]
    hints = [
        *_kv_hints(f),
        *_expert_hints(f),
        *_linear_state_hints(f),
        *_snapshot_hints(f),
        *_max_model_len_hints(f),
        *_together_hints(f),
        *_speculation_hints(f),
        *_kv_dtype_hints(f),
        *_budget_hints(f),
    ]
    if hints:
        lines.append("to fit, with everything else unchanged:")
        lines.extend(f"  {h}" for h in hints)
    else:
        lines.append(
            "every term above comes from defaults and the model itself; the KV floor defaults to one sequence of "
            "max_model_len tokens, and the expert floor is one MoE layer's experts"
        )
    return "\n".join(lines)


def _kv_pages_fitting(f: _Failure) -> int:
    pages = f.sizes.kv_pages
    return _largest(f.costs.kv, f.room_for(f.costs.kv, pages), 0, max(pages, 1)) or 0


def _kv_hints(f: _Failure) -> list[str]:
    """The KV pool's requirement or floor flag, if the user set one."""
    req, page_size = f.req, f.r.page_size
    if req.num_pages is not None:
        return [_hint("--num-pages", _kv_pages_fitting(f), 1)]
    if req.num_tokens is not None:
        return [_hint("--num-tokens", _kv_pages_fitting(f) * page_size, 1)]
    if req.kv_reserve_tokens is not None:
        return [_hint("--kv-reserve-tokens", _kv_pages_fitting(f) * page_size, 0)]
    return []


def _max_model_len_hints(f: _Failure) -> list[str]:
    """With no KV flag set, the KV floor is one sequence of --max-model-len tokens."""
    req = f.req
    if (
        req.max_model_len is None
        or req.kv_reserve_tokens is not None
        or req.num_tokens is not None
        or req.num_pages is not None
        or not f.sizes.kv_pages
    ):
        return []
    return [_hint("--max-model-len", _kv_pages_fitting(f) * f.r.page_size, 1)]


def _expert_hints(f: _Failure) -> list[str]:
    req, spec, slots = f.req, f.spec, f.sizes.expert_slots
    if req.moe_cache_size is None and req.moe_cache_rate is None:
        return []
    s = _largest(f.costs.experts, f.room_for(f.costs.experts, slots), 0, slots) or 0
    floor = min_expert_slots(spec)
    if req.moe_cache_size is not None:
        return [_hint("--moe-cache-size", s, floor)]
    rate = math.floor(s / spec.total_experts * 1e6) / 1e6
    while rate > 0 and math.ceil(rate * spec.total_experts) > s:
        rate -= 1e-6
    return [_hint("--moe-cache-rate", rate if s >= floor else 0, floor / spec.total_experts)]


def _linear_state_hints(f: _Failure) -> list[str]:
    if f.req.max_running_requests is None or not f.spec.linear_attention_layers:
        return []
    n = (
        _largest(
            f.costs.linear_state, f.room_for(f.costs.linear_state, f.sizes.linear_slots), 0, f.r.max_running_requests
        )
        or 0
    )
    return [_hint("--max-running-requests", n, 1)]


def _together_hints(f: _Failure) -> list[str]:
    """Where neither fewer running requests nor a shorter context fits alone, the most running requests (halving
    from the plan's) with which some context fits, and that context: a hybrid model's linear states and the KV
    floor of one max-length sequence are the two terms a user sizes."""
    req, sizes = f.req, f.sizes
    if (
        not f.spec.linear_attention_layers
        or req.kv_reserve_tokens is not None
        or req.num_tokens is not None
        or req.num_pages is not None
    ):
        return []
    alone_fits = _kv_pages_fitting(f) >= 1 or (
        _largest(
            f.costs.linear_state, f.room_for(f.costs.linear_state, sizes.linear_slots), 1, max(sizes.linear_slots, 1)
        )
        is not None
    )
    if alone_fits:
        return []
    fixed = f.terms.total - f.costs.kv(sizes.kv_pages) - f.costs.linear_state(sizes.linear_slots)
    n = f.r.max_running_requests
    while n >= 1:
        room = f.budget - fixed - f.costs.linear_state(n)
        pages = _largest(f.costs.kv, room, 1, max(sizes.kv_pages, 1))
        if pages is not None:
            return [f"--max-running-requests {n} --max-model-len {pages * f.r.page_size}: these fit together"]
        n //= 2
    return []


def _speculation_hints(f: _Failure) -> list[str]:
    """With --speculative-method mtp, what the MTP layers' weights and K/V take (plan/mtp_layer.py): at least what
    another method frees (the workspace's MTP pass besides), and whether that alone fits."""
    if f.req.speculative_method != "mtp":
        return []
    plain = dataclasses.replace(f.spec, mtp_kv_layers=0)
    kv = f.costs.kv(f.sizes.kv_pages) - _Costs(plain, f.r).kv(f.sizes.kv_pages)
    weights = mtp_resident_bytes(f.spec, f.r.dtype)
    over = f.terms.total - f.budget
    verdict = "the plan then fits" if weights + kv >= over else f"{format_bytes(over - weights - kv)} still over"
    return [
        f"--speculative-method ngram (or off): frees the MTP layer's {format_bytes(weights)} of weights and "
        f"{format_bytes(kv)} of K/V; {verdict}"
    ]


def _kv_dtype_hints(f: _Failure) -> list[str]:
    """With K/V in the model dtype, what fp8 K/V (values and their per-row scales) would free of the same pool,
    and whether that alone fits."""
    if f.r.kv_cache_dtype != "auto" or not f.sizes.kv_pages:
        return []
    fp8 = _Costs(f.spec, dataclasses.replace(f.r, kv_cache_dtype="fp8"))
    now, then = f.costs.kv(f.sizes.kv_pages), fp8.kv(f.sizes.kv_pages)
    over = f.terms.total - f.budget
    if now <= then:
        return []
    verdict = "the plan then fits" if now - then >= over else f"{format_bytes(over - (now - then))} still over"
    return [f"--kv-cache-dtype fp8: the KV pool's {format_bytes(now)} becomes {format_bytes(then)}; {verdict}"]


def _snapshot_hints(f: _Failure) -> list[str]:
    if f.req.linear_state_snapshots is None or not f.sizes.snapshots:
        return []
    n = _largest(f.costs.snapshots, f.room_for(f.costs.snapshots, f.sizes.snapshots), 0, f.sizes.snapshots) or 0
    return [
        _hint("--linear-state-snapshots", n, 0)
        if n
        else "--linear-state-snapshots: no value above 0 fits; 0 turns hybrid prefix reuse off"
    ]


def _budget_hints(f: _Failure) -> list[str]:
    req, r, total, outside = f.req, f.r, f.terms.total, f.measured.outside
    ratio_given = req.is_set("memory_ratio")
    hints = []
    if req.gpu_memory is not None:
        need = math.ceil((total + outside.bytes) / r.memory_ratio)
        while budget_for_base(need, r.memory_ratio, outside, ratio_given) < total:
            need += max(1, (total - budget_for_base(need, r.memory_ratio, outside, ratio_given)) // 2)
        hints.append(f"--gpu-memory would have to be at least {need} bytes ({format_bytes(need)})")
    if req.memory_ratio is not None:
        base = req.gpu_memory if req.gpu_memory is not None else f.measured.free_bytes
        needed_ratio = math.ceil((total + outside.bytes) / base * 1e4) / 1e4
        hints.append(
            f"--memory-ratio would have to be at least {needed_ratio:g}"
            if needed_ratio <= 1
            else "--memory-ratio: no value up to 1 fits"
        )
    return hints


def _hint(flag: str, largest: float, smallest_meaningful: float) -> str:
    if largest < smallest_meaningful or largest <= 0:
        return f"{flag}: no value fits; the other terms alone leave too little of the budget"
    return (
        f"{flag}: the largest value that fits is {largest:g}"
        if isinstance(largest, float)
        else f"{flag}: the largest value that fits is {largest}"
    )
