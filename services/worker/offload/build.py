"""How boot builds the expert store from a plan: all-resident when every expert has a slot,
otherwise host banks + a replacement policy + the offloading store.

The default policy is LFU, not LRU: decode visits the layers in a cycle, and once one step's
routed experts outnumber the slots (batch 8 on a 24 GiB card with Qwen3-30B-A3B), LRU evicts
exactly the experts the next layers need and its hit rate falls to zero, where LFU keeps ~50%
(bench/offload_policy_sim.py, Zipf-skewed routing with s = 1; to be confirmed with real routing).
LRU stays available by name.

Boot order: `allocate_pools` -> `build_expert_store` -> `store.load_expert(...)` for every
expert (checkpoint or dummy weights) -> `store.preload()` when the store has one.
"""

from __future__ import annotations

import torch

from shared.errors import ConfigError
from shared.model_config import ModelSpec
from services.worker.offload.expert_cache import OffloadedExperts
from services.worker.offload.host_banks import HostBanks
from services.worker.offload.frequency_policy import LFUExpertPolicy
from services.worker.offload.policy import ExpertSlotPolicy, LRUExpertPolicy
from services.worker.offload.resident import KernelResidentExperts
from services.worker.planner import Plan
from services.worker.pools import ExpertSlotPool


POLICIES: dict[str, type[ExpertSlotPolicy]] = {"lru": LRUExpertPolicy, "lfu": LFUExpertPolicy}
DEFAULT_POLICY = "lfu"


def make_policy(name: str, num_layers: int, num_experts: int, num_slots: int) -> ExpertSlotPolicy:
    if name not in POLICIES:
        raise ConfigError(f"unknown expert cache policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](num_layers, num_experts, num_slots)


def build_offloaded_experts(spec: ModelSpec, plan: Plan, slots: ExpertSlotPool, device: torch.device | str,
                            pin: bool | None = None, progress: bool = True, policy: str = DEFAULT_POLICY) -> OffloadedExperts:  # fmt: skip
    """Host banks for every routed expert (pinned when CUDA is present; fails first with a
    HostMemoryError if RAM is short) and a replacement policy over the plan's slots."""
    num_layers = len(spec.moe_layer_indices)
    chosen = make_policy(policy, num_layers, spec.num_experts, slots.num_slots)
    banks = HostBanks.for_model(spec, plan.dtype, pin=pin, progress=progress)
    return OffloadedExperts(slots, banks, chosen, device)


def build_expert_store(spec: ModelSpec, plan: Plan, slots: ExpertSlotPool, device: torch.device | str,
                       pin: bool | None = None, progress: bool = True,
                       policy: str = DEFAULT_POLICY) -> KernelResidentExperts | OffloadedExperts:  # fmt: skip
    """All-resident (no host banks, no host RAM, nothing copied) when the plan gave every expert
    a slot; otherwise the offload store."""
    if slots.num_slots >= spec.total_experts:
        return KernelResidentExperts(slots, len(spec.moe_layer_indices), spec.num_experts)
    return build_offloaded_experts(spec, plan, slots, device, pin=pin, progress=progress, policy=policy)
