"""How boot builds the expert store from a plan: all-resident when every expert has a slot,
otherwise host banks + LRU policy + the offloading store.

Boot order: `allocate_pools` -> `build_expert_store` -> `store.load_expert(...)` for every
expert (checkpoint or dummy weights) -> `store.preload()` when the store has one.
"""

from __future__ import annotations

import torch

from shared.model_config import ModelSpec
from services.worker.experts import ResidentExperts
from services.worker.offload.expert_cache import OffloadedExperts
from services.worker.offload.host_banks import HostBanks
from services.worker.offload.policy import LRUExpertPolicy
from services.worker.planner import Plan
from services.worker.pools import ExpertSlotPool


def build_offloaded_experts(spec: ModelSpec, plan: Plan, slots: ExpertSlotPool, device: torch.device | str,
                            pin: bool | None = None, progress: bool = True) -> OffloadedExperts:  # fmt: skip
    """Host banks for every routed expert (pinned when CUDA is present; fails first with a
    HostMemoryError if RAM is short) and an LRU policy over the plan's slots."""
    num_layers = len(spec.moe_layer_indices)
    banks = HostBanks.for_model(spec, plan.dtype, pin=pin, progress=progress)
    policy = LRUExpertPolicy(num_layers, spec.num_experts, slots.num_slots)
    return OffloadedExperts(slots, banks, policy, device)


def build_expert_store(spec: ModelSpec, plan: Plan, slots: ExpertSlotPool, device: torch.device | str,
                       pin: bool | None = None, progress: bool = True) -> ResidentExperts | OffloadedExperts:  # fmt: skip
    """ResidentExperts (no host banks, no host RAM) when the plan gave every expert a slot."""
    if slots.num_slots >= spec.total_experts:
        return ResidentExperts(slots, len(spec.moe_layer_indices), spec.num_experts)
    return build_offloaded_experts(spec, plan, slots, device, pin=pin, progress=progress)
