"""The offloading expert store: a cache of expert slots on the device, misses copied from host banks.

Per MoE layer (docs/ARCHITECTURE.md §3): route -> the layer's unique experts -> the policy gives each a slot
and names the misses -> misses are copied host bank -> slot on a dedicated copy stream -> the
grouped expert GEMM computes by slot. Copies and compute are ordered by CUDA events, not by
host synchronisation (the host waits only for the routing it needs, once per layer):

* before any copy, the copy stream waits for everything already queued on the compute stream
  (an evicted slot may still be read by an earlier layer's GEMM);
* the layer's experts are computed in groups: first the hits (they need no copy, so they run
  while the first misses are still crossing PCIe), then the misses chunk by chunk, each chunk
  waiting only for its own copies. With several chunks this is a double buffer within the layer:
  chunk i+1 is copied while chunk i is computed. The slots are the buffers, so what was copied
  stays cached. Small steps (decode) copy their misses as one chunk, since their compute is
  tiny next to a copy and more chunks only add launches; steps of `prefill_tokens` tokens or
  more split them into `pipeline_chunks` chunks.

Overlapping the *next* layer's copies with this layer's compute needs the next layer's routing
before it exists, i.e. prediction: the device-driven store's next-layer prefetch (device_driven.py,
docs/ARCHITECTURE.md §3).
Each (token, k) pair is computed in exactly one group into a float32 row buffer that is summed
over k at the end, so the result is bit for bit what an all-resident store computes.

On CPU the same schedule runs with plain synchronous copies: every bookkeeping path is tested.

Per-step device memory beyond the all-resident compute path (a group's slot map, the host-made
alignment) is stated in plan/costs.py:offload_workspace_bytes, which the plan adds when it offloads:
allocate more per step here and that function must say so.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import numpy as np
import torch

from ferry.kernels.align_pairs import align_pairs_by_slot_host
from ferry.kernels.aligned_blocks import block_m_for
from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton, use_pair_kernel
from ferry.kernels.expert_rows_sum import ExpertRows, finish_rows, new_rows
from ferry.kernels.grouped_expert_gemm import grouped_expert_rows, grouped_expert_rows_triton
from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.slot_cache.policy import NO_SLOT, ExpertSlotPolicy
from ferry.services.worker.offload.slot_cache.stats import ExpertCacheStats
from ferry.services.worker.pools import ExpertSlotPool

DEFAULT_PIPELINE_CHUNKS = 4
DEFAULT_PREFILL_TOKENS = 64
# Up to this many (token, k) pairs the Triton kernel's alignment is made on the host (decode:
# one small copy instead of ~25 tiny launches); above it, on the device (prefill: sorting tens
# of thousands of pairs per group in numpy would cost more host time than the GEMM takes).
DEFAULT_HOST_ALIGN_MAX_PAIRS = 4096


class OffloadedExperts:
    """An `ExpertStore` (services/worker/offload/stores/expert_store.py) over `slots.num_slots` device slots."""

    def __init__(
        self,
        slots: ExpertSlotPool,
        banks: HostBanks,
        policy: ExpertSlotPolicy,
        device: torch.device | str,
        pipeline_chunks: int = DEFAULT_PIPELINE_CHUNKS,
        prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        use_triton: bool | None = None,
        host_align_max_pairs: int = DEFAULT_HOST_ALIGN_MAX_PAIRS,
    ):
        """`use_triton`: compute with the Triton kernel (aligned on the host); default on CUDA
        only. Forcing it on CPU needs TRITON_INTERPRET=1 (tests of the CUDA path's bookkeeping)."""
        _check_compatible(slots, banks, policy)
        if pipeline_chunks < 1:
            raise ValueError(f"pipeline_chunks must be at least 1, got {pipeline_chunks}")
        self.slots = slots
        self.banks = banks
        self.policy = policy
        self.device = torch.device(device)
        self.num_experts = banks.num_experts
        self.pipeline_chunks = pipeline_chunks
        self.prefill_tokens = prefill_tokens
        self.stats = ExpertCacheStats()
        self._cuda = self.device.type == "cuda"
        self._triton = self._cuda if use_triton is None else use_triton
        self.host_align_max_pairs = host_align_max_pairs
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._last_layer = -1

    # ---- loading ---------------------------------------------------------------------------
    def load_expert(
        self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bias=None
    ) -> None:
        self.banks.load_expert(moe_layer, expert, gate, up, down, *(() if bias is None else (bias,)))
        s = int(self.policy.slot_of[moe_layer, expert])
        if s != NO_SLOT:  # reloaded while cached: the slot must not keep the old weights
            self.banks.copy_experts(moe_layer, [(expert, s)], self.slots.w13, self.slots.w2)

    def preload(self) -> int:
        """Warm-up after loading: copy experts into the free slots, layer by layer, without
        counting misses. A cache with a slot for every expert then never copies again."""
        placed = 0
        stream = self._copy_stream
        self.banks.seal()  # loading is over (packed banks lay their escapes out)
        if stream is not None:  # the slots' allocation zero-fills them on the compute stream: copy after it
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for layer in range(self.policy.num_layers):
                pairs = []
                for expert in range(self.num_experts):
                    s = self.policy.place_in_free_slot(layer, expert)
                    if s is not None:
                        pairs.append((expert, s))
                self.banks.copy_experts(layer, pairs, self.slots.w13, self.slots.w2, non_blocking=True)
                placed += len(pairs)
        if stream is not None:
            stream.synchronize()
        return placed

    def report(self) -> dict:
        """The `"expert_cache"` object of `ferry generate --json` and /metrics: the statistics
        (cumulative, with "last_step") and what the cache is."""
        return {
            **self.stats.to_dict(),
            "policy": self.policy.name,
            "slots": self.policy.num_slots,
            "total_experts": self.policy.num_layers * self.num_experts,
            "resident": self.policy.resident,
            "evictions": self.policy.evictions,
            "host_bank_bytes": self.banks.nbytes,
            "expert_format": self.banks.format.name,
        }

    # ---- the step ----------------------------------------------------------------------------
    def end_step(self, synced: bool = False, decode_tokens: int | None = None) -> None:
        """Close the current step's statistics (also done when layer 0 comes round again)."""
        self.stats.end_step()
        self._last_layer = -1

    def begin_step(self, num_tokens: int, top_k: int, long_context: bool = False) -> None:
        """Nothing to start: the host path copies each layer's misses once it has looked them up."""

    def count_step_on_device(self) -> None:
        """Nothing on the device: the host policy counts on the host."""

    def stats_to_host(self, counted: bool = False) -> None:
        """Nothing to queue: the host policy counted on the host."""

    def forward(
        self,
        moe_layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        n_rows: torch.Tensor | None = None,
        summed: bool = True,
    ) -> torch.Tensor | ExpertRows:
        """`n_rows` is not read: the host path never runs padded batches (CUDA graphs use DeviceDrivenExperts)."""
        if moe_layer <= self._last_layer:
            self.stats.end_step()
        self._last_layer = moe_layer
        # The one host round trip per layer: the policy runs on the host and needs the routing.
        ids = topk_ids.detach().to("cpu", torch.int64).numpy()
        experts = np.flatnonzero(np.bincount(ids.reshape(-1), minlength=self.num_experts))  # sorted, unique
        lookup = self.policy.lookup(moe_layer, experts)
        misses = list(lookup.misses)
        self.stats.record_lookup(lookup.hits, len(misses), len(misses) * self.banks.expert_nbytes)
        chunks = _split(misses, 1 if x.shape[0] < self.prefill_tokens else self.pipeline_chunks)
        groups = self._group_slots(ids, experts, lookup.slots, lookup.hits > 0, chunks)
        # no zero fill: the groups partition the pairs, so every row is written by exactly one group
        rows = new_rows(x, topk_ids.shape[1])  # float32, or the dtype past ROWS_FLOAT32_MAX_TOKENS
        if self._cuda:
            self._forward_pipelined_cuda(moe_layer, x, groups, topk_weights, chunks, rows)
        else:
            self._forward_sequential(moe_layer, x, groups, topk_weights, chunks, rows)
        return finish_rows(rows, x.dtype, summed)  # as the all-resident store finishes: same bits

    def _group_slots(
        self, ids: np.ndarray, experts: np.ndarray, slots: tuple[int, ...], has_hits: bool, chunks: list
    ) -> list[np.ndarray | None]:
        """Per compute group, the [T, k] slots of its pairs (-1 elsewhere): group 0 the hits (None
        when there are none), group 1 + i the misses of chunk i; one group of all pairs when
        nothing is missing."""
        slot_of = np.full(self.num_experts, NO_SLOT, dtype=np.int64)
        slot_of[experts] = slots
        pair_slots = slot_of[ids]
        if not chunks:
            return [pair_slots]
        group_of = np.zeros(self.num_experts, dtype=np.int64)
        for i, chunk in enumerate(chunks):
            group_of[[e for e, _ in chunk]] = 1 + i
        pair_group = group_of[ids]
        return [
            np.where(pair_group == g, pair_slots, NO_SLOT) if g or has_hits else None for g in range(1 + len(chunks))
        ]

    def _forward_sequential(self, layer, x, groups, topk_weights, chunks, rows) -> None:
        """CPU: the same schedule with synchronous copies (so every copy is exposed time)."""
        aligned = self._aligned(groups, topk_weights.numel())
        if groups[0] is not None:
            self._compute(layer, x, groups[0], topk_weights, rows, aligned[0])
        for i, chunk in enumerate(chunks):
            start = time.perf_counter()
            self.banks.copy_experts(layer, chunk, self.slots.w13, self.slots.w2)
            seconds = time.perf_counter() - start
            self.stats.record_copy_seconds(seconds, exposed=seconds)
            self._compute(layer, x, groups[1 + i], topk_weights, rows, aligned[1 + i])

    def _forward_pipelined_cuda(self, layer, x, groups, topk_weights, chunks, rows) -> None:
        aligned = self._aligned(groups, topk_weights.numel())
        if not chunks:
            self._compute(layer, x, groups[0], topk_weights, rows, aligned[0])
            return
        compute = torch.cuda.current_stream(self.device)
        copy = self._copy_stream
        queued = torch.cuda.Event()
        queued.record(compute)  # slots about to be overwritten may still be read by queued GEMMs
        copy.wait_event(queued)
        copied = []
        with torch.cuda.stream(copy):
            for chunk in chunks:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(copy)
                self.banks.copy_experts(layer, chunk, self.slots.w13, self.slots.w2, non_blocking=True)
                end.record(copy)
                self.stats.record_copy_events(start, end)
                copied.append(end)
        if groups[0] is not None:  # the hits, computed while the copies run
            self._compute(layer, x, groups[0], topk_weights, rows, aligned[0])
        for i, done in enumerate(copied):
            stall_start, stall_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stall_start.record(compute)
            compute.wait_event(done)
            stall_end.record(compute)
            self.stats.record_stall_events(stall_start, stall_end)
            self._compute(layer, x, groups[1 + i], topk_weights, rows, aligned[1 + i])

    def _aligned(self, groups: list[np.ndarray | None], num_pairs: int) -> list:
        """Per group, what the Triton kernels read: for small steps (decode) the group's [T, k] slots
        (the pair-by-pair kernel, as the all-resident store uses for the same step size), else a
        host-made alignment, or None (the kernel aligns on the device)."""
        if self._triton and use_pair_kernel(num_pairs):
            return self._slots_on_device(groups)
        if self._triton and num_pairs <= self.host_align_max_pairs:
            return self._align_on_host(groups, num_pairs)
        return [None] * len(groups)

    def _align_on_host(self, groups: list[np.ndarray | None], num_pairs: int) -> list:
        """Each group's (sorted_pairs, block_slot) for the Triton kernel, made with numpy and
        sent to the device in one copy (the kernel's own alignment would be ~25 tiny launches)."""
        block_m = block_m_for(num_pairs)
        parts = [align_pairs_by_slot_host(g, block_m) if g is not None else None for g in groups]
        flat = [a for p in parts if p is not None for a in p]
        packed = torch.from_numpy(np.concatenate(flat)).to(self.device)
        out, offset = [], 0
        for p in parts:
            if p is None:
                out.append(None)
                continue
            n_pairs, n_blocks = p[0].size, p[1].size
            out.append((packed[offset : offset + n_pairs], packed[offset + n_pairs : offset + n_pairs + n_blocks]))
            offset += n_pairs + n_blocks
        return out

    def _slots_on_device(self, groups: list[np.ndarray | None]) -> list:
        """Every group's slots sent in one host-to-device copy, as [T, k] int32 views."""
        present = [g for g in groups if g is not None]
        packed = torch.from_numpy(np.stack(present).astype(np.int32)).to(self.device)
        views = iter(packed.unbind(0))
        return [next(views) if g is not None else None for g in groups]

    def _compute(self, layer, x, group_slots, topk_weights, rows, aligned=None) -> None:
        gemm13, gemm2 = self.slots.layer_views(layer)
        if isinstance(aligned, torch.Tensor):  # a small step's slots, pair by pair
            expert_pair_rows_triton(x, aligned, topk_weights, gemm13, gemm2, rows)
            return
        if aligned is not None:
            grouped_expert_rows_triton(x, None, topk_weights, gemm13, gemm2, rows, aligned=aligned)
            return
        slots = torch.from_numpy(group_slots).to(x.device)
        if self._triton:  # a large step: the kernel aligns on the device, its grid bounded by this layer's experts
            grouped_expert_rows_triton(x, slots, topk_weights, gemm13, gemm2, rows, max_distinct_slots=self.num_experts)
        else:  # the reference on CPU (or whatever the dispatcher picks for this device)
            grouped_expert_rows(x, slots, topk_weights, gemm13, gemm2, rows)


def _split(misses: list, chunks: int) -> list[list]:
    """Misses in at most `chunks` consecutive chunks of near-equal size (none if no misses)."""
    n = min(chunks, len(misses))
    bounds = [len(misses) * i // n for i in range(n + 1)] if n else []
    return [misses[bounds[i] : bounds[i + 1]] for i in range(n)]


def _check_compatible(slots: ExpertSlotPool, banks: HostBanks, policy: ExpertSlotPolicy) -> None:
    if slots.num_slots != policy.num_slots:
        raise ValueError(f"the slot pool has {slots.num_slots} slots but the policy manages {policy.num_slots}")
    if (banks.num_layers, banks.num_experts) != (policy.num_layers, policy.num_experts):
        raise ValueError(
            f"host banks hold {banks.num_layers} layers x {banks.num_experts} experts, the policy "
            f"{policy.num_layers} x {policy.num_experts}"
        )
    expert, dtype = banks.slot_rows
    if tuple(slots.w13.shape[1:]) != expert or slots.w13.dtype != dtype:
        raise ValueError(
            f"slot shape {tuple(slots.w13.shape[1:])} {slots.w13.dtype} differs from the host banks' {expert} {dtype}"
        )
