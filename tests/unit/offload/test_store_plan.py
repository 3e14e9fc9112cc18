"""The plan prices the expert store that it leads to: an offloading plan carries the offload
store's per-step workspace, an all-resident plan does not (docs/ARCHITECTURE.md §2 rule 1)."""

from offload_tiny import tiny_spec

from ferry.plan.costs import offload_workspace_bytes
from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.plan.store_plan import plan_for_expert_store
from ferry.shared.units import MiB

SPEC = tiny_spec(layers=3, experts=6, top_k=2)
MEASURED = Measured(1 * MiB, 3 * MiB)


def _request(**flags) -> PlanRequest:
    return PlanRequest(gpu_memory=64 * MiB, dtype="float32", max_prefill_tokens=512, **flags)


def test_an_all_resident_plan_is_the_plain_plan():
    plan = plan_for_expert_store(SPEC, _request(), MEASURED)
    assert plan.experts.slots == plan.experts.total
    assert plan == make_plan(SPEC, _request(), MEASURED)


def test_an_offloading_plan_adds_the_offload_store_workspace():
    plan = plan_for_expert_store(SPEC, _request(moe_cache_size=7), MEASURED)
    extra = offload_workspace_bytes(SPEC, 512)
    assert plan.experts.slots == 7
    assert plan.workspace_bytes == MEASURED.workspace_bytes + extra
    # the slot map (int64) and host alignment (2 x int32) of 512 tokens x top-2 pairs at least
    assert extra >= 512 * 2 * (8 + 8)
    # the extra bytes come out of the automatic KV fill, nothing else moves
    plain = make_plan(SPEC, _request(moe_cache_size=7), MEASURED)
    assert plan.kv.bytes <= plain.kv.bytes and plan.total_bytes <= plan.budget_bytes
