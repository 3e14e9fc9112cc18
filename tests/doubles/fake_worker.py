"""`ferry worker --boot tests.doubles.fake_worker:boot_paged_hash_model`: the real worker service around the
PagedHashModel double, for integration tests until the real executor is merged.

The model directory holds the test tokenizer plus `paged_hash_model.json`:
{"vocab": [token ids it may produce], "step_delay_s": float, "linear_state_slots": int}.
Pool sizes come from the planner flags, as the real boot's plan would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ferry.plan.planner import ExpertPlan, KVPlan, LinearStatePlan, Plan
from ferry.services.worker.flags import WorkerBootConfig
from tests.doubles.paged_model import PagedHashModel


class DelayedExecutor:
    def __init__(self, model: PagedHashModel, delay: float):
        self.model, self.delay = model, delay

    def execute(self, batch):
        if self.delay:
            time.sleep(self.delay)
        return self.model.execute(batch)

    def expert_stats(self) -> tuple[int, int]:
        return 3 * self.model.steps, self.model.steps  # a fixed 75% hit rate, to see it reach /metrics


def boot_paged_hash_model(cfg: WorkerBootConfig):
    spec = json.loads((Path(cfg.model) / "paged_hash_model.json").read_text())
    req = cfg.plan
    pages = req.num_pages or 256
    page_size = req.page_size or 16
    slots = spec.get("linear_state_slots", 0)
    mrr = req.max_running_requests or 64
    kv = KVPlan(page_size=page_size, pages=pages, sentinel_pages=1, tokens=pages * page_size, bytes_per_token=0, bytes=0)
    plan = Plan(
        budget_bytes=0, budget_derivation="test double", weights_bytes=0, weights_source="test double",
        workspace_bytes=0, workspace_source="test double", total_bytes=0, headroom_bytes=0, kv=kv,
        linear_state=LinearStatePlan(slots=slots, padding_slots=1 if slots else 0, bytes_per_slot=0, bytes=0),
        experts=ExpertPlan(slots=0, total=0, min_slots=0, bytes_per_slot=0, bytes=0), dtype="float32",
        max_running_requests=mrr, max_prefill_tokens=req.max_prefill_tokens or 8192,
        max_model_len=req.max_model_len or 512,
    )  # fmt: skip
    model = PagedHashModel(pages, page_size, spec["vocab"], slots)
    return DelayedExecutor(model, spec.get("step_delay_s", 0.0)), plan
