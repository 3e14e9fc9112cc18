"""The all-resident expert store: every expert of every MoE layer in its own slot, nothing copied.

Boot builds it when the plan gives every expert a slot (slot = moe_layer * num_experts + expert).
It computes with the dispatching grouped expert GEMM (Triton on CUDA, the plain-torch reference
twin on CPU) — the same kernel `OffloadedExperts` uses, so the two agree bit for bit.

It keeps the same statistics as the offload store (every lookup a hit, nothing copied), so every
worker exports the same expert-cache metrics whatever its plan. Counting the layer's distinct
experts on the host would cost a device sync per layer; instead each layer marks its routed
experts in a [layers, experts] device table (one launch), which `end_step` sums and reads once,
after the executor has already waited for the step.

Small steps (decode) on the GPU go pair by pair (kernels/expert_pair_gemv.py) with the layer's
slot offset passed to the kernel: the routed expert ids are used as they are, with no alignment
and no add, and every pair is routed, so the row buffer needs no zero fill."""

from __future__ import annotations

import torch

from ferry.kernels.dispatch import use_triton
from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton, use_pair_kernel
from ferry.kernels.expert_rows_sum import sum_rows
from ferry.kernels.grouped_expert_gemm import grouped_expert_forward
from ferry.services.worker.offload.stats import ExpertCacheStats
from ferry.services.worker.pools import ExpertSlotPool


class ResidentExperts:
    """An `ExpertStore` (services/worker/experts.py) holding every expert."""

    policy_name = "all-resident"

    def __init__(self, slots: ExpertSlotPool, num_moe_layers: int, num_experts: int):
        needed = num_moe_layers * num_experts
        if slots.num_slots < needed:
            raise ValueError(f"ResidentExperts needs {needed} slots, the pool has {slots.num_slots}")
        self.slots = slots
        self.num_moe_layers = num_moe_layers
        self.num_experts = num_experts
        self.stats = ExpertCacheStats()
        self._routed: torch.Tensor | None = None  # bool [layers, experts]: routed this step, on the device
        self._last_layer = -1

    def _slot(self, moe_layer: int, expert: int) -> int:
        return moe_layer * self.num_experts + expert

    def load_expert(self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        s = self._slot(moe_layer, expert)
        inter = gate.shape[0]
        self.slots.w13[s, :inter].copy_(gate)
        self.slots.w13[s, inter:].copy_(up)
        self.slots.w2[s].copy_(down)

    def preload(self) -> int:
        """Nothing to warm: every expert was loaded straight into its slot."""
        return 0

    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if moe_layer <= self._last_layer:  # layer 0 came round again without end_step: a new step
            self.end_step()
        self._last_layer = moe_layer
        self._count_lookups(moe_layer, topk_ids)
        offset = moe_layer * self.num_experts
        if use_triton(x) and use_pair_kernel(topk_ids.numel()):
            rows = torch.empty(x.shape[0], topk_ids.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
            expert_pair_rows_triton(x, topk_ids, topk_weights, self.slots.w13, self.slots.w2, rows, slot_offset=offset)
            return sum_rows(rows, x.dtype)
        topk_slots = topk_ids + offset
        return grouped_expert_forward(x, topk_slots, topk_weights, self.slots.w13, self.slots.w2,
                                      max_distinct_slots=self.num_experts)  # one layer's experts at most

    def _count_lookups(self, moe_layer: int, topk_ids: torch.Tensor) -> None:
        # index_fill, not bincount: bincount on CUDA reads the maximum back to the host
        if self._routed is None:  # a new table per step: one launch per step, not per layer
            self._routed = torch.zeros(self.num_moe_layers, self.num_experts, dtype=torch.bool, device=topk_ids.device)
        self._routed[moe_layer].index_fill_(0, topk_ids.reshape(-1).to(torch.int64), True)

    def end_step(self) -> None:
        """Fold the step's lookups (all hits) into the statistics."""
        if self._routed is not None:
            # dropped, not zeroed: it may be an inference tensor, and end_step may run outside inference mode
            self.stats.record_lookup(int(self._routed.sum()), 0, 0)
            self._routed = None
        self.stats.end_step()
        self._last_layer = -1

    def report(self) -> dict:
        """Same keys as `OffloadedExperts.report()`: misses, bytes and copy times stay zero."""
        total = self.num_moe_layers * self.num_experts
        return {**self.stats.to_dict(), "policy": self.policy_name, "slots": self.slots.num_slots,
                "total_experts": total, "resident": total, "evictions": 0, "host_bank_bytes": 0}  # fmt: skip
