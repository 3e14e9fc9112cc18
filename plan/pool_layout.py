"""The byte layout of each GPU pool: the one cost model that the planner prices and the allocator allocates.

A pool is one flat byte buffer carved into typed views. Its size is the sum of its tensors,
each starting at a VIEW_ALIGN boundary, rounded up to POOL_ALIGN: the CUDA caching allocator
reserves large blocks in 2 MiB granules, so a buffer of a multiple of 2 MiB makes the bytes the
process reserves equal the bytes we priced (docs/ARCHITECTURE.md §2 rule 1). Sentinel pages and padding slots
are tensors rows like any other, so they are priced like any other.

No torch here: `ferry plan` prices pools on machines without it; `pools.py` allocates them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ferry.plan import expert_formats as F
from ferry.plan.dtypes import DTYPE_BYTES
from ferry.plan.kv_groups import KvGroup, kv_groups, ring_pages, uses_ring
from ferry.plan.model_config import ModelSpec
from ferry.shared.units import MiB, round_up

POOL_ALIGN = 2 * MiB
VIEW_ALIGN = 256
# --kv-cache-dtype fp8: K and V stored as float8 e4m3 values, each (token, kv head) row with one float32
# scale (its amax / 448). float32, not bf16: amax / 448 then rounds once, so the row's largest value lands on
# e4m3's 448 (a bf16 scale rounded down would push it past the range), and Triton loads it as it is; at
# head_dim 128-256 it is 1.6-3.1% of the values' bytes.
KV_CACHE_DTYPES = ("auto", "fp8")
KV_FP8_DTYPE = "float8_e4m3fn"
KV_SCALE_DTYPE = "float32"
# element sizes of every tensor a pool holds: model dtypes, fp8 KV and its scales, and the integer state of
# the expert cache
ELEMENT_BYTES = {**DTYPE_BYTES, KV_FP8_DTYPE: 1, "int8": 1, "uint8": 1, "int32": 4, "int64": 8}

# Page 0 of the KV pool is never handed to a request: padded and masked-out positions of a
# batch write there, so a real page is never touched by a token that is not its own.
KV_SENTINEL_PAGES = 1
# One extra linear-state slot takes the writes of padded batch rows, for the same reason.
LINEAR_PADDING_SLOTS = 1
# Recurrent Gated DeltaNet state is kept in float32, as the reference implementation computes it.
LINEAR_RECURRENT_DTYPE = "float32"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ELEMENT_BYTES[self.dtype]


@dataclass(frozen=True)
class PoolLayout:
    """Named tensors packed into one flat buffer."""

    name: str
    tensors: tuple[TensorSpec, ...]

    def offsets(self) -> tuple[int, ...]:
        out, cursor = [], 0
        for t in self.tensors:
            cursor = round_up(cursor, VIEW_ALIGN)
            out.append(cursor)
            cursor += t.nbytes
        return tuple(out)

    @property
    def nbytes(self) -> int:
        """The exact bytes the allocator takes for this pool (0 for an empty pool)."""
        if not self.tensors:
            return 0
        end = self.offsets()[-1] + self.tensors[-1].nbytes
        return round_up(end, POOL_ALIGN) if end else 0


# ---- the pools --------------------------------------------------------------------


def kv_group_bytes_per_token(group: KvGroup, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token in every layer of `group`: values, and with fp8 their scales."""
    values = ELEMENT_BYTES[KV_FP8_DTYPE] if kv_cache_dtype == "fp8" else DTYPE_BYTES[dtype]
    rows = len(group.layers) * 2 * group.kv_heads
    return rows * group.head_dim * values + _group_scale_bytes_per_token(group, kv_cache_dtype)


def _group_scale_bytes_per_token(group: KvGroup, kv_cache_dtype: str) -> int:
    if kv_cache_dtype != "fp8":
        return 0
    return len(group.layers) * 2 * group.kv_heads * ELEMENT_BYTES[KV_SCALE_DTYPE]


def kv_bytes_per_token(spec: ModelSpec, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token in every softmax-attention layer (linear-attention layers keep no KV), sliding ones
    included: what one token of context costs where no group keeps a ring."""
    return sum(kv_group_bytes_per_token(g, dtype, kv_cache_dtype) for g in kv_groups(spec))


def kv_scale_bytes_per_token(spec: ModelSpec, kv_cache_dtype: str) -> int:
    """The fp8 scales' part of kv_bytes_per_token: one per K and V row of every kv head and layer (0 with auto)."""
    return sum(_group_scale_bytes_per_token(g, kv_cache_dtype) for g in kv_groups(spec))


@dataclass(frozen=True)
class KvGroupLayout:
    """One KV group's tensors in the pool: "kv" [layers, 2, pages, page_size, kv_heads, head_dim] (the first
    group's name; the others' kv1, kv2 ...) and with fp8 its scales ("kv_scale", "kv1_scale" ...). `pages`: the
    context's pages and the sentinel, or, for a ring (ring_pages > 0), the request slots' and the padding
    slot's rings, slot s's ring at pages s x ring_pages onwards (kv_groups.ring_page)."""

    group: KvGroup
    name: str
    pages: int
    ring_pages: int  # 0: paged over the context with the scheduler's page ids
    # a ring's layers run over a step in slices of at most this many tokens (what the ring holds); 0: paged
    slice_tokens: int = 0

    @property
    def scale_name(self) -> str:
        return self.name + "_scale"


def kv_group_layouts(
    spec: ModelSpec, num_pages: int, page_size: int, ring_slots: int = 0, slice_tokens: int = 0
) -> tuple[KvGroupLayout, ...]:
    """Each KV group's tensor pages: `num_pages` usable pages plus the sentinel page(s) over the context, or
    rings for `ring_slots` request slots and the padding slot where they are fewer pages (kv_groups.uses_ring);
    `slice_tokens`: the most new tokens of a request a ring layer writes before attending
    (kv_groups.sliding_slice_tokens of the prefill chunk)."""
    context = num_pages + KV_SENTINEL_PAGES
    out = []
    for i, group in enumerate(kv_groups(spec)):
        ring = uses_ring(group, context, ring_slots, slice_tokens, page_size)
        per_ring = ring_pages(group.window, slice_tokens, page_size) if ring else 0
        pages = (ring_slots + 1) * per_ring if ring else context
        name = "kv" if i == 0 else f"kv{i}"
        out.append(KvGroupLayout(group, name, pages, per_ring, slice_tokens if ring else 0))
    return tuple(out)


def kv_pool_layout(
    spec: ModelSpec,
    dtype: str,
    num_pages: int,
    page_size: int,
    kv_cache_dtype: str = "auto",
    ring_slots: int = 0,
    slice_tokens: int = 0,
) -> PoolLayout:
    """Each KV group's K/V (kv_group_layouts) [layers, 2, pages, page_size, kv_heads, head_dim] in the model
    dtype (auto) or e4m3 (fp8), with fp8 its scales [layers, 2, pages, page_size, kv_heads] (float32), one a
    (token, kv head) row."""
    tensors: list[TensorSpec] = []
    for g in kv_group_layouts(spec, num_pages, page_size, ring_slots, slice_tokens):
        shape = (len(g.group.layers), 2, g.pages, page_size, g.group.kv_heads, g.group.head_dim)
        if kv_cache_dtype == "fp8":
            tensors += [TensorSpec(g.name, shape, KV_FP8_DTYPE), TensorSpec(g.scale_name, shape[:-1], KV_SCALE_DTYPE)]
        else:
            tensors.append(TensorSpec(g.name, shape, dtype))
    return PoolLayout("kv", tuple(tensors))


def linear_state_bytes_per_slot(spec: ModelSpec, dtype: str) -> int:
    if not spec.linear_attention_layers:
        return 0
    return sum(t.nbytes for t in linear_state_layout(spec, dtype, 1, padding=0).tensors)


def linear_state_layout(spec: ModelSpec, dtype: str, slots: int, padding: int = LINEAR_PADDING_SLOTS) -> PoolLayout:
    """The linear state (conv and recurrent parts) of every Gated DeltaNet layer, for `slots` requests plus padding."""
    layers = len(spec.linear_attention_layers)
    if layers == 0:
        return PoolLayout("linear_state", ())
    return PoolLayout("linear_state", _linear_state_tensors(spec, dtype, "", (layers, slots + padding)))


def linear_state_snapshot_layout(spec: ModelSpec, dtype: str, snapshots: int) -> PoolLayout:
    """`snapshots` copies of the whole linear state of one sequence at one position (every Gated DeltaNet
    layer's conv and recurrent state): the prefix cache of hybrid models (services/scheduler/
    state_snapshots.py hands out their ids 0..snapshots-1). Snapshot-major, [snapshots, layers, ...], so
    each snapshot is one contiguous block and a copy to or from a request's slot is one strided copy per
    tensor. No padding row: no batch row ever reads or writes a snapshot, only the step's state copies."""
    layers = len(spec.linear_attention_layers)
    if layers == 0 or snapshots <= 0:
        return PoolLayout("linear_state_snapshots", ())
    return PoolLayout("linear_state_snapshots", _linear_state_tensors(spec, dtype, "snapshot_", (snapshots, layers)))


def _linear_state_tensors(spec: ModelSpec, dtype: str, prefix: str, lead: tuple[int, int]) -> tuple[TensorSpec, ...]:
    """The conv state (model dtype) and the recurrent state (float32) of one position, behind `lead` axes."""
    conv = TensorSpec(prefix + "conv", (*lead, spec.linear_conv_dim, spec.linear_conv_kernel_dim - 1), dtype)
    recurrent = TensorSpec(
        prefix + "recurrent",
        (*lead, spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim),
        LINEAR_RECURRENT_DTYPE,
    )
    return (conv, recurrent)


def expert_bytes(spec: ModelSpec, dtype: str) -> int:
    """One routed expert in its slot: the fused gate+up projection and the down projection, in the
    slots' format (the run dtype, or the checkpoint's quantized format: plan/expert_formats/)."""
    return sum(F.slot_family_bytes(spec, dtype))


def expert_weight_tensors(spec: ModelSpec, dtype: str, slots: int, prefix: str = "") -> tuple[TensorSpec, ...]:
    """w13 = [gate; up] and w2 = down of `slots` slots: [S, 2I, H] and [S, H, I] of the run dtype, or
    for a quantized format one row of bytes per slot and family ([S, row bytes] uint8)."""
    (shape13, dtype13), (shape2, dtype2) = F.format_of(spec).slot_rows(spec, dtype)
    return (TensorSpec(prefix + "w13", (slots, *shape13), dtype13), TensorSpec(prefix + "w2", (slots, *shape2), dtype2))


# Staging slots of a prefill that streams its missed experts (services/worker/offload/host_memory/staging_ring.py):
# outside the cache, so a prefill, which routes to nearly every expert of every layer, copies each
# missed expert once and evicts nothing that the layers after it are about to read. As many bytes
# for every model: 32 of Qwen3-30B-A3B's 9.44 MB experts, 48 of Qwen3.6-35B-A3B's 6.29 MB ones.
# The ring cuts them into four bays, and each bay's chunk costs the host the same work whatever its
# size: with smaller experts more of them go to a chunk, so the copies, not the host, set the pace.
PREFILL_STAGING_BYTES = 32 * 3 * 768 * 2048 * 2


def prefill_staging_slots(spec: ModelSpec, dtype: str) -> int:
    """How many staging slots an offloading pool carries: PREFILL_STAGING_BYTES of experts, at least
    one, at most one layer's experts."""
    return max(1, min(spec.num_experts, PREFILL_STAGING_BYTES // expert_bytes(spec, dtype)))


def expert_slot_layout(spec: ModelSpec, dtype: str, slots: int, max_step_tokens: int = 0) -> PoolLayout:
    """`slots` expert slots shared by all MoE layers: w13 = [gate; up], w2 = down. With fewer
    slots than experts, also the prefill's staging slots (`prefill_staging_slots`) and the state
    of the device-side expert cache (`expert_cache_state`)."""
    weights = expert_weight_tensors(spec, dtype, slots)
    if slots >= spec.total_experts:
        return PoolLayout("experts", weights)
    staging = expert_weight_tensors(spec, dtype, prefill_staging_slots(spec, dtype), prefix="staging_")
    return PoolLayout("experts", weights + staging + expert_cache_state(spec, slots, max_step_tokens))


@dataclass(frozen=True)
class ExpertPoolParts:
    """What the expert pool's bytes are, read from its layout's tensors (for the plan to name them):
    the slots, the prefill's staging slots, the device cache's state and the alignment between views
    and at the pool's end. The four add up to the pool's bytes."""

    slot_bytes: int
    staging_slots: int
    staging_bytes: int
    cache_state_bytes: int
    padding_bytes: int


def expert_pool_parts(spec: ModelSpec, dtype: str, slots: int, max_step_tokens: int = 0) -> ExpertPoolParts:
    """`expert_slot_layout`'s bytes by part: its tensors by name, the alignment as what is left."""
    layout = expert_slot_layout(spec, dtype, slots, max_step_tokens)
    weights = {t.name for t in expert_weight_tensors(spec, dtype, slots)}
    staging = {t.name for t in expert_weight_tensors(spec, dtype, 1, prefix="staging_")}
    by_part = {"slots": 0, "staging": 0, "state": 0}
    for t in layout.tensors:
        by_part["slots" if t.name in weights else "staging" if t.name in staging else "state"] += t.nbytes
    return ExpertPoolParts(
        slot_bytes=by_part["slots"],
        staging_slots=prefill_staging_slots(spec, dtype) if by_part["staging"] else 0,
        staging_bytes=by_part["staging"],
        cache_state_bytes=by_part["state"],
        padding_bytes=layout.nbytes - sum(by_part.values()),
    )


# Counters of the device-side expert cache (kernels/expert_cache_lookup.py's NUM_COUNTERS).
EXPERT_CACHE_COUNTERS = 8
# Device timestamps per MoE layer (services/worker/offload/stores/device_driven.py): copies of the misses
# (start, end), of the next layer's prefetch (start, end), the compute stream before it waits for
# the prefetched experts and once it has computed the hits.
COPY_STAMPS = 6


def expert_cache_state(spec: ModelSpec, slots: int, max_step_tokens: int) -> tuple[TensorSpec, ...]:
    """What the device-side expert cache keeps (services/worker/offload/slot_cache/device_cache.py): the slot
    map and its inverse, the replacement state, scratch for its kernel, and what each MoE layer's
    lookup and prefetch hand to the copy kernel and the expert GEMMs. Priced with the slots, so the
    plan stays exact whatever the number of slots."""
    layers, e, k = len(spec.moe_layer_indices), spec.num_experts, spec.num_experts_per_tok
    pairs = max(1, max_step_tokens) * k
    return (
        TensorSpec("slot_of", (layers, e), "int32"),
        TensorSpec("requests", (layers, e), "float32"),
        TensorSpec("layer_of_slot", (slots,), "int32"),
        TensorSpec("expert_of_slot", (slots,), "int32"),
        TensorSpec("stamp", (slots,), "int64"),
        TensorSpec("prefetched", (slots,), "int8"),
        TensorSpec("slot_flags", (slots,), "int8"),
        TensorSpec("assign", (slots,), "int32"),
        TensorSpec("expert_flags", (e,), "int8"),
        # per slot, what the last placement into it evicted (layer * E + expert, -1: it was free) and that
        # expert's stamp: a miss handed to the host gives its slot back to it (kernels/expert_host_handoff.py)
        TensorSpec("evicted", (slots,), "int32"),
        TensorSpec("evicted_stamp", (slots,), "int64"),
        TensorSpec("clock", (1,), "int64"),
        TensorSpec("counters", (EXPERT_CACHE_COUNTERS,), "int64"),
        TensorSpec("hit_slots", (pairs,), "int32"),
        TensorSpec("miss_slots", (pairs,), "int32"),
        TensorSpec("lookup_misses", (layers, e, 2), "int32"),
        TensorSpec("lookup_count", (layers,), "int32"),
        TensorSpec("prefetch_misses", (layers, e, 2), "int32"),
        TensorSpec("prefetch_count", (layers,), "int32"),
        TensorSpec("copy_stamps", (layers, COPY_STAMPS), "int64"),
    )
