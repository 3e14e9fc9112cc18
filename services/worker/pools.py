"""The GPU pools, allocated exactly as `pool_layout` prices them (docs/ARCHITECTURE.md §2 rule 1).

Each pool is one flat byte buffer carved into typed views, so the bytes the allocator takes
are the bytes the planner priced; `allocate_pools` checks that and refuses to continue if not.
The same code allocates on CPU (tests, CPU serving) and on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.plan import pool_layout as L
from ferry.plan.model_config import ModelSpec
from ferry.plan.planner import Plan
from ferry.services.worker.expert_formats import expert_format_for
from ferry.shared.errors import FerryError
from ferry.shared.units import ceil_div

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# every element type a pool holds (an fp8 KV pool's values; the expert cache's state is integers)
POOL_DTYPES = {
    **TORCH_DTYPES,
    L.KV_FP8_DTYPE: torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}


class PoolAllocationError(FerryError):
    """The device memory taken by the pools differs from the plan: we refuse to start."""


@dataclass
class AllocatedPool:
    layout: L.PoolLayout
    buffer: torch.Tensor  # uint8 [layout.nbytes]
    views: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.buffer.untyped_storage().nbytes()


def allocate_pool(layout: L.PoolLayout, device: torch.device | str) -> AllocatedPool:
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device)
    views = {}
    for spec, offset in zip(layout.tensors, layout.offsets()):
        flat = buffer[offset : offset + spec.nbytes].view(POOL_DTYPES[spec.dtype])
        views[spec.name] = flat.view(spec.shape)
    return AllocatedPool(layout, buffer, views)


class KvTensorPool:
    """The worker's KV pool: one tensor per KV group (plan/kv_groups.py, pool_layout.kv_group_layouts),
    [layers, 2, pages, page_size, kv_heads, head_dim] in the model dtype; or (--kv-cache-dtype fp8) in e4m3 with
    its scales [layers, 2, pages, page_size, kv_heads] float32 beside it (kernels/paged_attention_reference.
    quantize_kv_rows). A group paged over the context is behind the scheduler's page ids (its KvPagePool), page 0
    the sentinel; a sliding group in rings is addressed by the request's slot (kv_groups.ring_page), its
    `ring_pages` > 0. `kv` and `scale` are the first group's tensors. `dtype` is the model's: what the attention
    computes in, and what the gather buffers hold.

    `gather_tokens` (the plan's max_model_len; None for the workspace profile's temporary pool) sizes
    the buffers a long prefill gathers one request's K/V into for FlashAttention
    (kernels/paged_attention_flash.py), in the first group's shape (a full one, where the model has one):
    allocated at the first such prefill and kept, so their bytes are taken once, at the size the workspace
    priced (`gathered_context_bytes`), however the contexts grow from chunk to chunk. Without it each gather
    is a fresh tensor."""

    def __init__(
        self,
        pool: AllocatedPool,
        groups: tuple[L.KvGroupLayout, ...],
        page_size: int,
        gather_tokens: int | None = None,
        dtype: torch.dtype | None = None,
    ):
        self.pool = pool
        self.groups = groups
        self.kv = pool.views[groups[0].name]
        self.scale = pool.views.get(groups[0].scale_name)
        if self.scale is not None and dtype is None:
            raise ValueError("an fp8 KV pool needs the model dtype (dtype) its attention computes in")
        self.dtype = dtype if dtype is not None else self.kv.dtype
        self.page_size = page_size
        # layer -> (its group's K/V tensor, its scales or None, its index in the group, the group's ring pages,
        # the most tokens of a step its ring holds at once)
        self._where = {
            layer: (pool.views[g.name], pool.views.get(g.scale_name), i, g.ring_pages, g.slice_tokens)
            for g in groups
            for i, layer in enumerate(g.group.layers)
        }
        self.gather_pages = ceil_div(gather_tokens, page_size) if gather_tokens else 0
        self._gather: tuple[torch.Tensor, torch.Tensor] | None = None

    def gather_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) [gather_pages, page_size, kv_heads, head_dim] for one request's context, or None."""
        if not self.gather_pages:
            return None
        if self._gather is None:
            shape = (self.gather_pages, *self.kv.shape[3:])
            self._gather = (
                torch.empty(shape, dtype=self.dtype, device=self.kv.device),
                torch.empty(shape, dtype=self.dtype, device=self.kv.device),
            )
        return self._gather

    def gather_for(self, layer_idx: int):
        """`gather_buffers` where the layer's K/V have the buffers' shape, else None (its gathers are fresh)."""
        kv = self._where[layer_idx][0]
        return self.gather_buffers if kv.shape[3:] == self.kv.shape[3:] else None

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one softmax-attention layer, each [pages, page_size, kv_heads, head_dim]."""
        kv, _, i, _, _ = self._where[layer_idx]
        return kv[i, 0], kv[i, 1]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(K scales, V scales) of one layer of an fp8 pool, each [pages, page_size, kv_heads]; (None, None)
        where the pool holds the model dtype."""
        _, scale, i, _, _ = self._where[layer_idx]
        if scale is None:
            return None, None
        return scale[i, 0], scale[i, 1]

    def ring_pages(self, layer_idx: int) -> int:
        """The pages of each request's ring in the layer's group; 0 where the group is paged over the context."""
        return self._where[layer_idx][3]

    def slice_tokens(self, layer_idx: int) -> int:
        """The most new tokens of a step a ring layer may write before attending: it runs over longer steps in
        slices of this many (services/worker/mixer_slices.py); 0 where the layer keeps no ring (or no KV)."""
        where = self._where.get(layer_idx)
        return where[4] if where else 0


class LinearStatePool:
    """The linear state (Gated DeltaNet layers): conv [layers, slots + padding, conv_dim, kernel - 1] and
    recurrent [layers, slots + padding, v_heads, k_head_dim, v_head_dim] (float32); and, in a pool of its
    own (`snapshots`, None when the plan has none), the prefix cache's snapshots of whole states,
    snapshot-major: snapshot_conv [snapshots, layers, ...], snapshot_recurrent [snapshots, layers, ...].

    A snapshot moves to or from a request's slot with `restore` / `save`: one device-side copy per
    tensor and pair, no host round trip and no temporary (the step's state copies, shared/step.py)."""

    def __init__(
        self, pool: AllocatedPool, linear_attention_layers: tuple[int, ...], snapshots: AllocatedPool | None = None
    ):
        self.pool = pool
        self.conv = pool.views.get("conv")
        self.recurrent = pool.views.get("recurrent")
        self._index = {layer: i for i, layer in enumerate(linear_attention_layers)}
        self.snapshots = snapshots
        self.snapshot_conv = snapshots.views["snapshot_conv"] if snapshots is not None else None
        self.snapshot_recurrent = snapshots.views["snapshot_recurrent"] if snapshots is not None else None

    @property
    def num_snapshots(self) -> int:
        return 0 if self.snapshot_conv is None else int(self.snapshot_conv.shape[0])

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes + (self.snapshots.nbytes if self.snapshots is not None else 0)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index[layer_idx]
        return self.conv[i], self.recurrent[i]

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """(snapshot, slot): the slot takes the snapshot's state (every layer's conv and recurrent parts)."""
        for snapshot, slot in pairs:
            self.conv[:, slot].copy_(self.snapshot_conv[snapshot])
            self.recurrent[:, slot].copy_(self.snapshot_recurrent[snapshot])

    def save(self, pairs: list[tuple[int, int]]) -> None:
        """(slot, snapshot): the snapshot takes the slot's state."""
        for slot, snapshot in pairs:
            self.snapshot_conv[snapshot].copy_(self.conv[:, slot])
            self.snapshot_recurrent[snapshot].copy_(self.recurrent[:, slot])

    def save_layer(self, layer: int, snapshot: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """One linear layer's part of a snapshot, from states computed inside a row's chunk (a save at a
        point of the chunk that is not its end: the layer keeps it during the forward)."""
        i = self._index[layer]
        self.snapshot_conv[snapshot, i].copy_(conv)
        self.snapshot_recurrent[snapshot, i].copy_(recurrent)


class ExpertSlotPool:
    """GPU expert slots shared by all MoE layers: w13 [slots, 2*I, H] (gate rows then up rows), w2 [slots, H, I]
    in the run dtype, or for a quantized expert format one byte row per slot and family ([slots, B]);
    when the pool offloads, the prefill's staging slots `staging_w13`/`staging_w2` (same rows, outside
    the cache) and `cache_state`, the device-side expert cache's tensors by name; else None and {}.

    Copies move the rows (`w13`, `w2`); the expert kernels read `gemm13`/`gemm2` (and
    `staging_gemm13`/`staging_gemm2`): the same tensors in bf16, typed views of the rows' parts
    (kernels/quantized_experts.py) in a quantized format. `fmt` (services/worker/expert_formats)
    says which; without it the pool must hold plain rows. A format whose rows differ by MoE layer
    (`views_per_layer`: a GGUF mix of types) has no views for every layer (those four are None):
    `layer_views(moe_layer)` gives each layer's, as it gives the shared ones for the others."""

    def __init__(self, pool: AllocatedPool, fmt=None):
        self.pool = pool
        self.w13 = pool.views["w13"]
        self.w2 = pool.views["w2"]
        self.staging_w13 = pool.views.get("staging_w13")
        self.staging_w2 = pool.views.get("staging_w2")
        weights = ("w13", "w2", "staging_w13", "staging_w2")
        self.cache_state = {name: t for name, t in pool.views.items() if name not in weights}
        if fmt is None:
            from ferry.services.worker.expert_formats.bf16 import Bf16Experts

            if self.w13.dim() != 3:
                raise ValueError("a pool of quantized expert rows needs its expert format (fmt)")
            fmt = Bf16Experts(self.w13.shape[2], self.w2.shape[2], self.w13.dtype)
        self.format = fmt
        self.gemm13 = self.gemm2 = self.staging_gemm13 = self.staging_gemm2 = None
        self._layer_views: dict[tuple[int, bool], tuple] = {}
        if not fmt.views_per_layer:
            self.gemm13, self.gemm2 = fmt.gemm_views(self.w13, self.w2)
            if self.staging_w13 is not None:
                self.staging_gemm13, self.staging_gemm2 = fmt.gemm_views(self.staging_w13, self.staging_w2)

    def layer_views(self, moe_layer: int, staging: bool = False) -> tuple:
        """(gemm13, gemm2) the expert kernels read for MoE layer `moe_layer`'s experts in these slots, or in the
        staging slots (`staging`: a streamed prefill's ring bays)."""
        if not self.format.views_per_layer:
            return (self.staging_gemm13, self.staging_gemm2) if staging else (self.gemm13, self.gemm2)
        key = (moe_layer, staging)
        if key not in self._layer_views:
            w13, w2 = (self.staging_w13, self.staging_w2) if staging else (self.w13, self.w2)
            self._layer_views[key] = self.format.gemm_views(w13, w2, moe_layer)
        return self._layer_views[key]

    @property
    def num_slots(self) -> int:
        return self.w13.shape[0]


@dataclass
class Pools:
    kv: KvTensorPool
    linear_state: LinearStatePool | None
    experts: ExpertSlotPool

    @property
    def nbytes(self) -> int:
        total = self.kv.pool.nbytes + self.experts.pool.nbytes
        return total + (self.linear_state.nbytes if self.linear_state else 0)


def planned_kv_layout(spec: ModelSpec, plan: Plan) -> L.PoolLayout:
    """The KV pool the plan priced: its context pages, and the rings it keeps for its request slots."""
    kv = plan.kv
    return L.kv_pool_layout(
        spec, plan.dtype, kv.pages, kv.page_size, kv.cache_dtype, kv.ring_slots, kv.ring_slice_tokens
    )


def planned_kv_groups(spec: ModelSpec, plan: Plan) -> tuple[L.KvGroupLayout, ...]:
    kv = plan.kv
    return L.kv_group_layouts(spec, kv.pages, kv.page_size, kv.ring_slots, kv.ring_slice_tokens)


def pool_layouts(spec: ModelSpec, plan: Plan) -> tuple[L.PoolLayout, ...]:
    """The layouts the plan priced, rebuilt from the plan's counts with the same functions: KV, linear
    state, expert slots, linear-state snapshots."""
    return (
        planned_kv_layout(spec, plan),
        L.linear_state_layout(spec, plan.dtype, plan.linear_state.slots),
        L.expert_slot_layout(spec, plan.dtype, plan.experts.slots, plan.max_prefill_tokens),
        L.linear_state_snapshot_layout(spec, plan.dtype, plan.linear_state_snapshots.snapshots),
    )


def allocate_pools(spec: ModelSpec, plan: Plan, device: torch.device | str) -> Pools:
    """Allocate the pools and check, on CUDA through the allocator's own counter, that the memory
    taken equals the plan."""
    device = torch.device(device)
    kv_layout, linear_layout, expert_layout, snapshot_layout = pool_layouts(spec, plan)
    priced = {
        "kv": plan.kv.bytes,
        "linear_state": plan.linear_state.bytes,
        "experts": plan.experts.bytes,
        "linear_state_snapshots": plan.linear_state_snapshots.bytes,
    }
    for layout in (kv_layout, linear_layout, expert_layout, snapshot_layout):
        if layout.nbytes != priced[layout.name]:
            raise PoolAllocationError(
                f"{layout.name} pool layout is {layout.nbytes} B but the plan priced "
                f"{priced[layout.name]} B: the plan was made for another model or dtype"
            )
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    kv = KvTensorPool(
        allocate_pool(kv_layout, device),
        planned_kv_groups(spec, plan),
        plan.kv.page_size,
        gather_tokens=plan.max_model_len,
        dtype=TORCH_DTYPES[plan.dtype],
    )
    linear = None
    if linear_layout.tensors:
        snapshots = allocate_pool(snapshot_layout, device) if snapshot_layout.tensors else None
        linear = LinearStatePool(allocate_pool(linear_layout, device), spec.linear_attention_layers, snapshots)
    experts = ExpertSlotPool(allocate_pool(expert_layout, device), expert_format_for(spec, TORCH_DTYPES[plan.dtype]))
    pools = Pools(kv, linear, experts)
    planned = plan.kv.bytes + plan.linear_state.bytes + plan.linear_state_snapshots.bytes + plan.experts.bytes
    taken = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else pools.nbytes
    if taken != planned:
        raise PoolAllocationError(
            f"the pools took {taken} B of device memory but the plan priced {planned} B; "
            "refusing to start (docs/ARCHITECTURE.md §2 rule 1)"
        )
    return pools
