"""Where a MoE layer's routed experts are computed: the interface, and the all-resident store.

Models call `store.forward(moe_layer, x, topk_ids, topk_weights)` and never see slots. A store
maps (moe_layer, expert) to a slot of the planner-sized `ExpertSlotPool` and runs the grouped
expert GEMM by slot. `ResidentExperts` is the store for a cache that holds every expert (slot =
moe_layer * num_experts + expert); the offload store (services/worker/offload/) implements the
same interface with fewer slots and copies misses from host banks.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kernels.moe_reference import grouped_expert_forward_reference
from services.worker.pools import ExpertSlotPool


class ExpertStore(Protocol):
    num_experts: int

    def load_expert(self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Take one expert's weights: gate and up [I, H], down [H, I] (checkpoint layout)."""

    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token t; [T, H] in x's dtype."""


class ResidentExperts:
    """Every expert of every MoE layer lives in its own slot; nothing is ever copied."""

    def __init__(self, slots: ExpertSlotPool, num_moe_layers: int, num_experts: int):
        needed = num_moe_layers * num_experts
        if slots.num_slots < needed:
            raise ValueError(f"ResidentExperts needs {needed} slots, the pool has {slots.num_slots}")
        self.slots = slots
        self.num_experts = num_experts

    def _slot(self, moe_layer: int, expert: int) -> int:
        return moe_layer * self.num_experts + expert

    def load_expert(self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        s = self._slot(moe_layer, expert)
        inter = gate.shape[0]
        self.slots.w13[s, :inter].copy_(gate)
        self.slots.w13[s, inter:].copy_(up)
        self.slots.w2[s].copy_(down)

    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        topk_slots = topk_ids + moe_layer * self.num_experts
        return grouped_expert_forward_reference(x, topk_slots, topk_weights, self.slots.w13, self.slots.w2)
