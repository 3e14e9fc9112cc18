"""The worker's boot `plan` log line is short enough to read (it was 1,300-1,560 characters): the key
sizes at info, every term of the plan at debug (`plan_detail`)."""

from __future__ import annotations

import json

import pytest
import structlog

from ferry.plan.model_config import load_model_config
from ferry.plan.plan_report import plan_detail_fields, plan_log_fields
from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.shared.logging import configure_logging
from ferry.shared.units import GiB, format_bytes
from tests.helpers import QWEN3_6_35B, QWEN3_30B

KEY_FIELDS = {
    "budget",
    "weights",
    "workspace",
    "kv_tokens",
    "expert_slots",
    "expert_total",
    "snapshots",
    "max_running_requests",
    "max_model_len",
    "max_prefill_tokens",
    "expert_backend",
}


@pytest.mark.parametrize("model", [QWEN3_30B, QWEN3_6_35B], ids=lambda p: p.name)
def test_the_plan_line_is_short_and_says_the_key_sizes(model, capsys):
    spec = load_model_config(model)
    plan = make_plan(spec, PlanRequest(gpu_memory=24 * GiB), Measured(2 * GiB, 3 * GiB, host_available_bytes=512 * GiB))
    try:
        configure_logging("worker", fmt="json")
        log = structlog.get_logger("boot")
        log.info("plan", **plan_log_fields(plan))  # as the boot logs it
        log.debug("plan_detail", **plan_detail_fields(plan))
        lines = capsys.readouterr().err.strip().splitlines()
    finally:
        configure_logging("pytest", fmt="json")
    (line,) = lines  # the detail is at debug: not at the default level
    fields = json.loads(line)
    own = {k: v for k, v in fields.items() if k not in ("event", "process", "level", "timestamp")}
    assert len(json.dumps(own)) < 300 and len(line) < 380, (len(line), line)  # the rest: every line's envelope
    assert KEY_FIELDS <= set(fields), KEY_FIELDS - set(fields)
    assert (
        fields["budget"] == format_bytes(plan.budget_bytes) and fields["max_model_len"] == spec.max_position_embeddings
    )
    assert (fields["expert_slots"], fields["expert_total"]) == (plan.experts.slots, plan.experts.total)


def test_the_detail_keeps_every_term_in_bytes():
    plan = make_plan(
        load_model_config(QWEN3_6_35B),
        PlanRequest(gpu_memory=24 * GiB),
        Measured(2 * GiB, 3 * GiB, host_available_bytes=512 * GiB),
    )
    detail = plan_detail_fields(plan)
    assert detail["budget_bytes"] == plan.budget_bytes and detail["kv_bytes"] == plan.kv.bytes
    assert detail["linear_state_snapshot_bytes"] == plan.linear_state_snapshots.bytes
    assert detail["host_expert_bank_bytes"] == plan.host.expert_bank_bytes
