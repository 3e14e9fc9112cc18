"""Boot's choice of expert store from a plan: all-resident when every expert has a slot, else offload."""

import pytest
import torch
from offload_tiny import random_experts, random_routing, tiny_spec

from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_forward_reference
from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.services.worker.offload.stores.build import build_expert_store
from ferry.services.worker.offload.stores.offloaded import OffloadedExperts
from ferry.services.worker.offload.stores.resident import ResidentExperts
from ferry.services.worker.pools import allocate_pools
from ferry.shared.errors import ConfigError
from ferry.shared.units import MiB

SPEC = tiny_spec(layers=3, experts=6, top_k=2)


def _store(policy="lfu", **flags):
    plan = make_plan(SPEC, PlanRequest(gpu_memory=64 * MiB, dtype="float32", **flags), Measured(1 * MiB, 1 * MiB))
    pools = allocate_pools(SPEC, plan, "cpu")
    return plan, build_expert_store(SPEC, plan, pools.experts, "cpu", progress=False, policy=policy)


def test_every_expert_in_a_slot_needs_no_host_banks():
    plan, store = _store()
    assert plan.experts.slots == plan.experts.total == 18
    assert isinstance(store, ResidentExperts)
    for (layer, e), weights in random_experts(SPEC, 1).items():
        store.load_expert(layer, e, *weights)
    g = torch.Generator().manual_seed(1)
    for layer in range(3):
        x, ids, w = random_routing(SPEC, 5, g)
        want = grouped_expert_forward_reference(x, ids + layer * 6, w, store.slots.w13, store.slots.w2)
        assert torch.equal(store.forward(layer, x, ids, w), want)
    store.end_step()
    report = store.report()
    assert report["misses"] == report["bytes_copied"] == 0 and report["hits"] > 0 and report["hit_rate"] == 1.0
    assert report["slots"] == report["total_experts"] == report["resident"] == 18


def test_fewer_slots_than_experts_builds_the_offload_store_and_it_serves():
    plan, store = _store(moe_cache_size=7)
    assert isinstance(store, OffloadedExperts)
    assert store.policy.num_slots == 7 and store.banks.num_layers == 3 and store.banks.num_experts == 6
    for (layer, e), weights in random_experts(SPEC, 0).items():
        store.load_expert(layer, e, *weights)
    assert store.preload() == 7  # warm-up fills the free slots
    g = torch.Generator().manual_seed(0)
    for layer in range(3):
        out = store.forward(layer, *random_routing(SPEC, 4, g))
        assert out.shape == (4, SPEC.hidden_size) and torch.isfinite(out).all()
    store.end_step()
    assert store.stats.total.hits + store.stats.total.misses > 0


def test_the_policy_is_chosen_by_name():
    _, store = _store(policy="lru", moe_cache_size=7)
    assert store.policy.name == "lru"
    plan = make_plan(SPEC, PlanRequest(gpu_memory=64 * MiB, dtype="float32", moe_cache_size=7), Measured(MiB, MiB))
    default = build_expert_store(SPEC, plan, allocate_pools(SPEC, plan, "cpu").experts, "cpu", progress=False)
    assert default.policy.name == "lfu"
    with pytest.raises(ConfigError, match="unknown expert cache policy 'mru'; choose one of lru, lfu"):
        _store(policy="mru", moe_cache_size=7)
