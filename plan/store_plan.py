"""The plan with the expert store's own per-step workspace in it (docs/ARCHITECTURE.md §2 rule 1: the plan is exact).

Which store runs depends on the plan (offload when it gives fewer slots than experts), and the
offload store needs a little more per-step memory than the all-resident path the workspace was
measured (or estimated) with. So: plan once; if that plan offloads, plan again with the offload
store's extra bytes added to the workspace. More workspace only ever means fewer slots, so the
second plan offloads too and the store it leads to is the one it priced."""

from __future__ import annotations

import dataclasses

from ferry.plan.costs import offload_workspace_bytes
from ferry.plan.model_config import ModelSpec
from ferry.plan.planner import Measured, Plan, PlanRequest, make_plan


def plan_for_expert_store(spec: ModelSpec, req: PlanRequest, measured: Measured) -> Plan:
    plan = make_plan(spec, req, measured)
    if plan.experts.slots >= spec.total_experts:
        return plan
    extra = offload_workspace_bytes(spec, plan.max_prefill_tokens)
    return make_plan(spec, req, dataclasses.replace(measured, workspace_bytes=measured.workspace_bytes + extra))
