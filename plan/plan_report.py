"""The plan as people read it: a log line, a table. (JSON is `Plan.to_dict()`.)"""

from __future__ import annotations

from ferry.plan import expert_formats as F
from ferry.plan.costs import MIXER_SLICE_TOKENS
from ferry.plan.expert_backend import format_cpu_list, pool_thread_cpus
from ferry.plan.kv_groups import ring_pages, sliding_slice_tokens
from ferry.plan.planner import Plan
from ferry.plan.pool_layout import POOL_ALIGN, VIEW_ALIGN
from ferry.shared.units import format_bytes

HEADER = ("term", "size", "bytes", "how it was sized")
# HostPlan.available_source of a plan for another machine whose banks this one could not hold
# (`ferry plan --gpu-memory` without --host-memory): its host RAM is not checked, not failed
HOST_NOT_CHECKED = "not checked"


def _kv_group_rows(plan: Plan) -> list[tuple]:
    """A row per KV group (plan/kv_groups.py) where there are several: its layers' shape, and its pages over the
    context or its rings."""
    if len(plan.kv.groups) < 2:
        return []
    rows = []
    for g in plan.kv.groups:
        kind = f"sliding window {g.window}" if g.window else "full attention"
        if g.ring_pages:
            kept = (
                f"{plan.kv.ring_slots} + 1 padding rings x {g.ring_pages} pages (window + "
                f"{plan.kv.ring_slice_tokens}-token slice)"
            )
        else:
            kept = f"{g.pages} pages over the context"
            if g.window:  # why no ring: one per running request would not be smaller
                rings = (plan.max_running_requests + 1) * ring_pages(
                    g.window, sliding_slice_tokens(plan.max_prefill_tokens), plan.kv.page_size
                )
                kept += f" (rings for {plan.max_running_requests} requests would take {rings})"
        rows.append(
            (
                f"  KV group: {kind}",
                g.bytes,
                f"{len(g.layers)} layers x {g.kv_heads} kv heads x {g.head_dim}; {kept}; {g.bytes_per_token} B/token",
            )
        )
    return rows


def plan_table(plan: Plan, host_here: int | None = None) -> str:
    """The table; `host_here`: this machine's MemAvailable when the host check was not made."""
    rows = [
        ("budget", plan.budget_bytes, plan.budget_derivation),
        ("weights (GPU-resident)", plan.weights_bytes, plan.weights_source),
        (
            "activation workspace",
            plan.workspace_bytes,
            f"{plan.workspace_source}, {plan.max_prefill_tokens}-token step"
            f"{_mixer_slices(plan)} ({plan.max_prefill_tokens_source})",
        ),
        (
            "KV pool",
            plan.kv.bytes,
            f"{plan.kv.pages} pages x {plan.kv.page_size} = {plan.kv.tokens} tokens + "
            f"{plan.kv.sentinel_pages} sentinel; "
            f"{plan.kv.bytes_per_token} B/token"
            + (f" (fp8 e4m3, {plan.kv.scale_bytes_per_token} B of it scales)" if plan.kv.cache_dtype == "fp8" else ""),
        ),
        *_kv_group_rows(plan),
        (
            "linear-state pool",
            plan.linear_state.bytes,
            f"{plan.linear_state.slots} slots + {plan.linear_state.padding_slots} padding; "
            f"{format_bytes(plan.linear_state.bytes_per_slot)}/slot",
        ),
        *_snapshot_rows(plan),
        (
            "expert pool",
            plan.experts.bytes,
            f"{plan.experts.slots} of {plan.experts.total} experts "
            f"({100 * plan.experts.slots / max(plan.experts.total, 1):.1f}%); {plan.experts.bytes_per_slot} B/slot, "
            f"{plan.experts.format}{_row_mix(plan)}" + ("; the parts below" if _expert_parts(plan) else ""),
        ),
        *_expert_parts(plan),
        ("total", plan.total_bytes, "device memory the worker takes"),
        ("headroom", plan.headroom_bytes, "budget - total"),
    ]
    host = plan.host
    if not host.expert_bank_bytes:
        banks_detail = "none: every expert has a GPU slot"
    else:
        banks_detail = F.named(plan.experts.format).banks_detail(plan.experts.total, plan.experts.bytes_per_slot)
    host_rows = [("host: expert banks (pinned)", host.expert_bank_bytes, banks_detail)]
    if host.available_source == HOST_NOT_CHECKED:
        here = f"{format_bytes(host_here)}" if host_here is not None else "less"
        host_rows.append(
            (
                "host: available",
                None,
                f"not checked: the banks need {format_bytes(host.expert_bank_bytes + host.reserve_bytes)} "
                f"({format_bytes(host.reserve_bytes)} reserve included), this machine has {here} "
                "(MemAvailable); give --host-memory SIZE of the machine the worker will run on",
            )
        )
    elif host.available_bytes is not None:
        host_rows.append(
            (
                "host: available",
                host.available_bytes,
                f"{host.available_source}; {format_bytes(host.reserve_bytes)} of it kept for the rest",
            )
        )
    else:
        host_rows.append(("host: available", None, "unknown (no /proc/meminfo); give --host-memory to check"))
    b = plan.expert_backend
    backend = {
        "gpu": "the GPU computes every expert (each miss crosses PCIe)",
        "hybrid": "the host computes part of each layer's misses while the rest cross PCIe, split by costs "
        "the worker measures at boot"
        + (
            " (auto: decode layers only, where they say it wins; --expert-backend hybrid shares prefills too)"
            if not b.prefill_share
            else ""
        ),
        "cpu": "the host computes every missed expert",
    }[b.backend]
    threads = f"; {b.host_threads} host threads ({b.reason})" if b.host_threads else f" ({b.reason})"
    if b.host_threads:
        caller, workers = pool_thread_cpus(b.host_threads, b.host_cpus)
        # the caller's CPU is taken by the thread that hands decode layers to the pool (a CUDA graph's host nodes,
        # or the polling thread); the worker's own thread, calling for a prefill's share, stays where it is
        threads += f", the decode hand-off's thread pinned to CPU {caller}" if caller is not None else ", unpinned"
        cpus = format_cpu_list(sorted(set(workers)))
        threads += (
            f", {len(workers)} worker{'s' if len(workers) > 1 else ''} to CPU{'s' if len(set(workers)) > 1 else ''} "
            f"{cpus}"
            if workers
            else ""
        )
    return _render([*rows, *host_rows], split_before=len(rows)) + (
        f"\ndtype {plan.dtype}, max_model_len {plan.max_model_len}, max_running_requests {plan.max_running_requests}"
        + (f" ({plan.sizing_source})" if plan.sizing_source else "")
        + f"\nexpert backend {b.backend} (--expert-backend {b.requested}): {backend}{threads}"
    )


def _snapshot_rows(plan: Plan) -> list[tuple[str, int, str]]:
    """The linear-state snapshots (hybrid models only): the prefix cache's states, and how many."""
    s = plan.linear_state_snapshots
    if not plan.linear_state.slots:
        return []
    if not s.snapshots:
        return [("linear-state snapshots", 0, f"none: prefix reuse is off for this hybrid model ({s.source})")]
    return [
        (
            "linear-state snapshots",
            s.bytes,
            f"{s.snapshots} x {format_bytes(s.bytes_per_snapshot)}: "
            f"the prefix cache's Gated DeltaNet states ({s.source})",
        )
    ]


def _row_mix(plan: Plan) -> str:
    """A format whose rows differ by MoE layer: each family's types (MoE layers of each) and what sizing every slot
    to the largest rows leaves unused, as bytes of all routed experts' rows and as their share."""
    e = plan.experts
    if not e.row_types:
        return ""
    types = "; ".join(
        f"{family} " + ", ".join(f"{t} x{n}" for t, n in sorted(counts.items(), key=lambda c: (-c[1], c[0])))
        for family, counts in e.row_types.items()
    )
    share = e.row_padding_bytes / max(1, e.total * e.bytes_per_slot)
    return (
        f" (MoE layers by row type: {types}; rows sized to the largest, so the smaller layers' experts leave "
        f"{e.row_padding_bytes} B of the {e.total} experts' rows unused: {100 * share:.1f}%)"
    )


def _expert_parts(plan: Plan) -> list[tuple[str, int, str]]:
    """The expert pool's bytes, named (indented: parts of the row above, not more terms of the total);
    none when the pool is its slots alone."""
    e = plan.experts
    slot_bytes = e.slots * e.bytes_per_slot
    if slot_bytes == e.bytes:
        return []
    rows = [("  expert slots", slot_bytes, f"{e.slots} x {e.bytes_per_slot} B")]
    if e.staging_slots:
        rows.append(
            (
                "  prefill staging slots",
                e.staging_bytes,
                f"{e.staging_slots} x {e.bytes_per_slot} B: a prefill's missed experts stream through them, "
                "past the cache",
            )
        )
    if e.cache_state_bytes:
        rows.append(
            (
                "  expert cache state",
                e.cache_state_bytes,
                "the device cache's slot map, replacement state and per-layer lookup and copy lists",
            )
        )
    if e.padding_bytes:
        rows.append(
            (
                "  alignment",
                e.padding_bytes,
                f"views on {VIEW_ALIGN} B boundaries, the pool rounded to "
                f"{format_bytes(POOL_ALIGN)} allocator segments",
            )
        )
    return rows


def _render(rows: list[tuple[str, int | None, str]], split_before: int) -> str:
    cells = [
        (name, format_bytes(n) if n is not None else "-", f"{n}" if n is not None else "-", detail)
        for name, n, detail in rows
    ]
    widths = [max(len(c[i]) for c in [HEADER, *cells]) for i in range(3)]

    def line(c: tuple[str, str, str, str]) -> str:
        return f"{c[0]:<{widths[0]}}  {c[1]:>{widths[1]}}  {c[2]:>{widths[2]}}  {c[3]}".rstrip()

    rule = "  ".join("-" * w for w in widths) + "  " + "-" * len(HEADER[3])
    lines = [
        line(HEADER),
        rule,
        *(line(c) for c in cells[:split_before]),
        rule,
        *(line(c) for c in cells[split_before:]),
    ]
    return "\n".join(lines)


def plan_log_fields(plan: Plan) -> dict:
    """The boot's `plan` log line: the key sizes only, so that the line stays short (a few hundred
    characters) where a person reads it; every term is in plan_detail_fields (logged at debug), the
    worker's /health and `ferry plan`."""
    return {
        "budget": format_bytes(plan.budget_bytes),
        "weights": format_bytes(plan.weights_bytes),
        "workspace": format_bytes(plan.workspace_bytes),
        "kv_tokens": plan.kv.tokens,
        "expert_slots": plan.experts.slots,
        "expert_total": plan.experts.total,
        "snapshots": plan.linear_state_snapshots.snapshots,
        "max_running_requests": plan.max_running_requests,
        "max_model_len": plan.max_model_len,
        "max_prefill_tokens": plan.max_prefill_tokens,
        "expert_backend": plan.expert_backend.backend,
    }


def plan_detail_fields(plan: Plan) -> dict:
    """Every term of the plan as flat fields, in bytes: the boot's `plan_detail` debug line."""
    return {
        "budget_bytes": plan.budget_bytes,
        "total_bytes": plan.total_bytes,
        "headroom_bytes": plan.headroom_bytes,
        "weights_bytes": plan.weights_bytes,
        "workspace_bytes": plan.workspace_bytes,
        "max_prefill_tokens": plan.max_prefill_tokens,
        "max_prefill_tokens_source": plan.max_prefill_tokens_source,
        "mixer_slice_tokens": min(plan.max_prefill_tokens, MIXER_SLICE_TOKENS),
        "kv_tokens": plan.kv.tokens,
        "kv_bytes": plan.kv.bytes,
        "kv_cache_dtype": plan.kv.cache_dtype,
        "linear_state_slots": plan.linear_state.slots,
        "linear_state_bytes": plan.linear_state.bytes,
        "linear_state_snapshots": plan.linear_state_snapshots.snapshots,
        "linear_state_snapshot_bytes": plan.linear_state_snapshots.bytes,
        "expert_slots": plan.experts.slots,
        "expert_total": plan.experts.total,
        "expert_bytes": plan.experts.bytes,
        "expert_format": plan.experts.format,
        "expert_staging_bytes": plan.experts.staging_bytes,
        "expert_cache_state_bytes": plan.experts.cache_state_bytes,
        "host_expert_bank_bytes": plan.host.expert_bank_bytes,
        "host_expert_bank_format": plan.host.expert_bank_format,
        "host_available_bytes": plan.host.available_bytes,
    }


def _mixer_slices(plan: Plan) -> str:
    """How a step longer than a mixer slice runs its token mixers (services/worker/mixer_slices.py)."""
    if plan.max_prefill_tokens <= MIXER_SLICE_TOKENS:
        return ""
    return f", its token mixers in slices of {MIXER_SLICE_TOKENS}"
