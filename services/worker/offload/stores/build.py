"""How boot builds the expert store from a plan: all-resident when every expert has a slot,
otherwise host banks + a replacement policy + the offloading store.

The default policy is LFU, not LRU: decode visits the layers in a cycle, and once one step's
routed experts outnumber the slots (batch 8 on a 24 GiB card with Qwen3-30B-A3B), LRU evicts
exactly the experts the next layers need and its hit rate falls to zero, where LFU keeps ~50%
(bench/offload_policy_sim.py, Zipf-skewed routing with s = 1; to be confirmed with real routing).
LRU stays available by name.

Boot order: plan -> `host_banks_for` (when offloading: RAM is checked and the banks allocated
before any device pool, so a host-RAM shortage fails first) -> `allocate_pools` ->
`build_expert_store` -> every expert loaded (`store.load_expert`, or `banks.fill_dummy` for dummy
weights) -> `store.preload()`.
"""

from __future__ import annotations

import torch

from ferry.kernels.dispatch import use_triton
from ferry.plan.model_config import ModelSpec
from ferry.plan.planner import Plan
from ferry.services.worker.expert_formats import bank_format_for
from ferry.services.worker.flags import DEFAULT_EXPERT_POLICY, EXPERT_POLICIES
from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks
from ferry.services.worker.offload.slot_cache.frequency_policy import LFUExpertPolicy
from ferry.services.worker.offload.slot_cache.policy import ExpertSlotPolicy, LRUExpertPolicy
from ferry.services.worker.offload.stores.device_driven import DeviceDrivenExperts
from ferry.services.worker.offload.stores.offloaded import OffloadedExperts
from ferry.services.worker.offload.stores.resident import ResidentExperts
from ferry.services.worker.pools import ExpertSlotPool
from ferry.shared.errors import ConfigError

POLICIES: dict[str, type[ExpertSlotPolicy]] = {"lru": LRUExpertPolicy, "lfu": LFUExpertPolicy}
DEFAULT_POLICY = DEFAULT_EXPERT_POLICY
# the bank classes, the first that `holds` the banks' expert format keeps them (HostBanks: any, as the slots do)
BANK_KINDS = (PackedHostBanks, HostBanks)
assert set(POLICIES) == set(EXPERT_POLICIES), "--expert-policy's choices must be the policies built here"


def check_policy_name(name: str) -> None:
    if name not in POLICIES:
        raise ConfigError(f"--expert-policy: unknown expert cache policy {name!r}; choose one of {', '.join(POLICIES)}")


def make_policy(name: str, num_layers: int, num_experts: int, num_slots: int) -> ExpertSlotPolicy:
    check_policy_name(name)
    return POLICIES[name](num_layers, num_experts, num_slots)


def is_offloaded(spec: ModelSpec, plan: Plan) -> bool:
    """Fewer slots than routed experts: the plan needs the offload store."""
    return plan.experts.slots < spec.total_experts


def host_banks_for(
    spec: ModelSpec, plan: Plan, pin: bool | None = None, progress: bool = True
) -> HostBanks | PackedHostBanks:
    """Host banks for every routed expert in the plan's format (packed: 12 bits a value), pinned
    when CUDA is present; a HostMemoryError naming the bytes needed and available comes before
    anything is allocated."""
    fmt = bank_format_for(spec, plan)
    kind = next(k for k in BANK_KINDS if k.holds(fmt))
    return kind.for_model(spec, plan.dtype, pin=pin, progress=progress)


def build_offloaded_experts(
    spec: ModelSpec,
    plan: Plan,
    slots: ExpertSlotPool,
    device: torch.device | str,
    pin: bool | None = None,
    progress: bool = True,
    policy: str = DEFAULT_POLICY,
    banks: HostBanks | None = None,
    prefetch: bool = True,
    device_driven: bool | None = None,
    copy_engine_tokens: int | None = None,
    ring_chunks: tuple[int | None, int | None] = (None, None),
) -> OffloadedExperts:
    """The offload store over the plan's slots: `banks` (allocated here when not given) and a
    replacement policy chosen by name. On CUDA (or wherever kernels run through Triton:
    `device_driven`) the cache is driven from the device, with next-layer `prefetch`; on CPU
    the host policy drives it."""
    num_layers = len(spec.moe_layer_indices)
    chosen = make_policy(policy, num_layers, spec.num_experts, slots.num_slots)
    if banks is None:
        banks = host_banks_for(spec, plan, pin=pin, progress=progress)
    if device_driven is None:
        device_driven = use_triton(slots.w13)
    if device_driven:
        store = DeviceDrivenExperts(
            slots,
            banks,
            chosen,
            device,
            prefetch=prefetch,
            copy_engine_tokens=copy_engine_tokens,
            ring_chunks=ring_chunks,
        )
        store.attention_period = max(1, round(num_layers / max(1, len(spec.full_attention_layers))))
        return store
    return OffloadedExperts(slots, banks, chosen, device)


def build_expert_store(
    spec: ModelSpec,
    plan: Plan,
    slots: ExpertSlotPool,
    device: torch.device | str,
    pin: bool | None = None,
    progress: bool = True,
    policy: str = DEFAULT_POLICY,
    banks: HostBanks | None = None,
    prefetch: bool = True,
    copy_engine_tokens: int | None = None,
    ring_chunks: tuple[int | None, int | None] = (None, None),
) -> ResidentExperts | OffloadedExperts:
    """All-resident (no host banks, no host RAM, nothing copied) when the plan gave every expert
    a slot; otherwise the offload store."""
    check_policy_name(policy)  # the flag is checked whichever store the plan leads to
    if slots.num_slots >= spec.total_experts:
        return ResidentExperts(slots, len(spec.moe_layer_indices), spec.num_experts)
    return build_offloaded_experts(
        spec,
        plan,
        slots,
        device,
        pin=pin,
        progress=progress,
        policy=policy,
        banks=banks,
        prefetch=prefetch,
        copy_engine_tokens=copy_engine_tokens,
        ring_chunks=ring_chunks,
    )
