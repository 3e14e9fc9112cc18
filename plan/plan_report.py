"""The plan as people read it: a log line, a table. (JSON is `Plan.to_dict()`.)"""

from __future__ import annotations

from ferry.shared.units import format_bytes
from ferry.plan.planner import Plan


def plan_table(plan: Plan) -> str:
    rows = [
        ("budget", plan.budget_bytes, plan.budget_derivation),
        ("weights (GPU-resident)", plan.weights_bytes, plan.weights_source),
        ("activation workspace", plan.workspace_bytes, f"{plan.workspace_source}, {plan.max_prefill_tokens}-token step"),
        ("KV pool", plan.kv.bytes,
         f"{plan.kv.pages} pages x {plan.kv.page_size} = {plan.kv.tokens} tokens + {plan.kv.sentinel_pages} sentinel; "
         f"{plan.kv.bytes_per_token} B/token"),
        ("linear-state pool", plan.linear_state.bytes,
         f"{plan.linear_state.slots} slots + {plan.linear_state.padding_slots} padding; "
         f"{format_bytes(plan.linear_state.bytes_per_slot)}/slot"),
        ("expert slots", plan.experts.bytes,
         f"{plan.experts.slots} of {plan.experts.total} experts "
         f"({100 * plan.experts.slots / max(plan.experts.total, 1):.1f}%); {plan.experts.bytes_per_slot} B/slot"),
        ("total", plan.total_bytes, ""),
        ("headroom", plan.headroom_bytes, "budget - total"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    lines = [f"{name:<{width}}  {format_bytes(n):>11}  {n:>15}  {detail}".rstrip() for name, n, detail in rows]
    lines.append(
        f"dtype {plan.dtype}, max_model_len {plan.max_model_len}, max_running_requests {plan.max_running_requests}"
    )
    return "\n".join(lines)


def plan_log_fields(plan: Plan) -> dict:
    """Flat fields for the one structured boot log line."""
    return {
        "budget_bytes": plan.budget_bytes,
        "total_bytes": plan.total_bytes,
        "headroom_bytes": plan.headroom_bytes,
        "weights_bytes": plan.weights_bytes,
        "workspace_bytes": plan.workspace_bytes,
        "kv_tokens": plan.kv.tokens,
        "kv_bytes": plan.kv.bytes,
        "linear_state_slots": plan.linear_state.slots,
        "linear_state_bytes": plan.linear_state.bytes,
        "expert_slots": plan.experts.slots,
        "expert_total": plan.experts.total,
        "expert_bytes": plan.experts.bytes,
    }
