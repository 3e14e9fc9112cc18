"""The all-resident expert store: every expert of every MoE layer in its own slot, nothing copied.

Boot builds it when the plan gives every expert a slot (slot = moe_layer * num_experts + expert).
It computes with the dispatching grouped expert GEMM (Triton on CUDA, the plain-torch reference
twin on CPU) — the same kernel `OffloadedExperts` uses, so the two agree bit for bit.

It keeps the same statistics as the offload store (every lookup a hit, nothing copied), so every
worker exports the same expert-cache metrics whatever its plan. Counting the layer's distinct
experts on the host would cost a device sync per layer; instead each layer marks its routed
experts in a persistent [layers, experts] device table (graph-safe), which `stats_to_host` sums
and queues to the host before the step's one synchronisation.

Small steps (decode) on the GPU go pair by pair (kernels/expert_pair_gemv.py) with the layer's
slot offset passed to the kernel: the routed expert ids are used as they are, with no alignment
and no add, and every pair is routed, so the row buffer needs no zero fill. Their gate/up kernel
marks the table too (a slot's index is its table entry), and the rows are left for the next
kernel to sum when the caller allows it (`summed=False`, kernels/expert_rows_sum.py): a decode
step's MoE layer is then the pair kernels' two launches. Larger steps mark with a kernel of their
own (kernels/router_topk.py)."""

from __future__ import annotations

from collections import deque

import torch

from ferry.kernels.dispatch import use_triton
from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton, use_pair_kernel
from ferry.kernels.expert_rows_sum import ExpertRows, finish_rows
from ferry.kernels.grouped_expert_gemm import grouped_expert_forward
from ferry.kernels.router_topk import mark_routed
from ferry.services.worker.offload.slot_cache.stats import ExpertCacheStats
from ferry.services.worker.pools import ExpertSlotPool


class ResidentExperts:
    """An `ExpertStore` (services/worker/offload/stores/expert_store.py) holding every expert."""

    policy_name = "all-resident"

    def __init__(self, slots: ExpertSlotPool, num_moe_layers: int, num_experts: int):
        needed = num_moe_layers * num_experts
        if slots.num_slots < needed:
            raise ValueError(f"ResidentExperts needs {needed} slots, the pool has {slots.num_slots}")
        self.slots = slots
        self.num_moe_layers = num_moe_layers
        self.num_experts = num_experts
        self.stats = ExpertCacheStats()
        self._routed: torch.Tensor | None = None  # int32 [layers, experts]: routed this step, on the device
        # counts queued by stats_to_host, not yet read: one per step in flight, oldest first (a step
        # scheduled ahead is launched before the one before it is folded)
        self._queued: deque[torch.Tensor] = deque()
        self._spare: list[torch.Tensor] = []  # pinned counts already read: reused, not allocated each step

    def _slot(self, moe_layer: int, expert: int) -> int:
        return moe_layer * self.num_experts + expert

    def load_expert(
        self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bias=None
    ) -> None:
        """Straight into its slot, in the slots' format (a quantized expert stays quantized)."""
        s = self._slot(moe_layer, expert)
        where = f"MoE layer {moe_layer} expert {expert}"
        biased = () if bias is None else (bias,)  # a format without biases takes no such argument
        self.slots.format.write_expert(self.slots.w13[s], self.slots.w2[s], gate, up, down, where, *biased)

    def fill_dummy(self, seed: int = 0) -> None:
        """--load-format dummy for a quantized format: every layer's slots filled in place."""
        e = self.num_experts
        for layer in range(self.num_moe_layers):
            rows = slice(layer * e, (layer + 1) * e)
            self.slots.format.fill_dummy_layer(self.slots.w13[rows], self.slots.w2[rows], layer, seed)

    def preload(self) -> int:
        """Nothing to warm: every expert was loaded straight into its slot."""
        return 0

    def forward(
        self,
        moe_layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        n_rows: torch.Tensor | None = None,
        summed: bool = True,
    ) -> torch.Tensor | ExpertRows:
        offset = moe_layer * self.num_experts
        gemm13, gemm2 = self.slots.layer_views(moe_layer)
        if use_triton(x) and use_pair_kernel(topk_ids.numel()):
            # the gate/up kernel marks the routed experts itself: slot layer * E + e is entry (layer, e)
            rows = torch.empty(x.shape[0], topk_ids.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
            expert_pair_rows_triton(
                x,
                topk_ids,
                topk_weights,
                gemm13,
                gemm2,
                rows,
                slot_offset=offset,
                mark=(self._routed_table(x.device), n_rows),
            )
            return finish_rows(rows, x.dtype, summed)
        self._count_lookups(moe_layer, topk_ids, n_rows)
        topk_slots = topk_ids + offset
        return grouped_expert_forward(
            x, topk_slots, topk_weights, gemm13, gemm2, max_distinct_slots=self.num_experts
        )  # one layer's experts at most

    def _count_lookups(self, moe_layer: int, topk_ids: torch.Tensor, n_rows: torch.Tensor | None) -> None:
        """Mark the layer's routed experts in the step's [layers, experts] device table, rows past
        n_rows (padding) left out; no host sync, graph-safe (fixed addresses). One small kernel on
        the Triton path (kernels/router_topk.py), one scatter in its torch twin elsewhere: the
        torch sequence was five launches per MoE layer of a decode step. (A decode step's pair kernels
        mark them in their gate/up launch instead: see `forward`.)"""
        mark_routed(self._routed_table(topk_ids.device), moe_layer, topk_ids, n_rows)

    def _routed_table(self, device: torch.device) -> torch.Tensor:
        if self._routed is None or self._routed.device != device:
            self._routed = torch.zeros(self.num_moe_layers, self.num_experts, dtype=torch.int32, device=device)
            self._routed_sum = torch.zeros(1, dtype=torch.int64, device=device)
        return self._routed

    def begin_step(self, num_tokens: int, top_k: int, long_context: bool = False) -> None:
        """Nothing to copy: every expert is resident."""

    def count_step_on_device(self) -> None:
        """The step's count of distinct routed experts, and the table cleared for the next step."""
        if self._routed is None:
            return
        with torch.inference_mode():  # the table was made inside the forward's inference mode
            self._routed_sum.copy_(self._routed.sum(dtype=torch.int64).view(1))
            self._routed.zero_()

    def stats_to_host(self, counted: bool = False) -> None:
        """Queue the step's count of distinct routed experts to the host (counted first unless its graph did)."""
        if self._routed is None:
            return
        if not counted:
            self.count_step_on_device()
        host = self._spare.pop() if self._spare else torch.empty(1, dtype=torch.int64, pin_memory=self._routed.is_cuda)
        host.copy_(self._routed_sum, non_blocking=self._routed.is_cuda)
        self._queued.append(host)

    def end_step(self, synced: bool = False, decode_tokens: int | None = None) -> None:
        """Fold the step's lookups (all hits) into the statistics. `synced`: the caller has already
        waited for everything queued (the executor's one wait per step), so no second wait here."""
        if self._routed is not None and not self._queued:
            self.stats_to_host()
            synced = False
        if self._queued:
            host = self._queued.popleft()
            if self._routed.is_cuda and not synced:
                torch.cuda.current_stream(self._routed.device).synchronize()
            self.stats.record_lookup(int(host[0]), 0, 0)
            self._spare.append(host)
        self.stats.end_step()

    def report(self) -> dict:
        """Same keys as `OffloadedExperts.report()`: misses, bytes and copy times stay zero."""
        total = self.num_moe_layers * self.num_experts
        return {
            **self.stats.to_dict(),
            "policy": self.policy_name,
            "slots": self.slots.num_slots,
            "total_experts": total,
            "resident": total,
            "evictions": 0,
            "host_bank_bytes": 0,
            "expert_format": self.slots.format.name,
        }
