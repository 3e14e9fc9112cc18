"""`ferry worker --boot tests.doubles.fake_worker:boot_paged_hash_model`: the real worker service around the
PagedHashModel double, for integration tests until the real executor is merged.

The model directory holds the test tokenizer plus `paged_hash_model.json`:
{"vocab": [token ids it may produce], "vocab_size": int, "step_delay_s": float, "delayed_steps": int | null,
 "linear_state_slots": int, "script": {"trigger": text, "token_ids": [...]}}  (optional).
Each step sleeps step_delay_s first; with delayed_steps set, only the first that many steps do.
With a script, a request whose prompt contains the trigger text gets the script's tokens as its
output, one per step (fixed model output, e.g. a tool call, through the real api and scheduler);
every other request gets the hash model's continuation. Pool sizes come from the planner flags,
as the real boot's plan would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import numpy as np

from ferry.plan.planner import ExpertPlan, HostPlan, KVPlan, LinearStatePlan, Plan
from ferry.services.worker.flags import WorkerBootConfig
from tests.doubles.paged_model import PagedHashModel


class DelayedExecutor:
    def __init__(
        self,
        model: PagedHashModel,
        delay: float,
        script: dict | None = None,
        tokenizer=None,
        vocab_size: int = 0,
        delayed_steps: int | None = None,
    ):
        self.model, self.delay = model, delay
        self.delays_left = delayed_steps  # None: every step is delayed
        self.vocab_size = vocab_size  # as the real model: a token id past it fails the whole step
        self.script = script
        self.tokenizer = tokenizer
        self.scripted: dict[int, int] = {}  # req id -> script tokens emitted so far
        self.last_sampled: dict[int, int] = {}  # req id -> the token the step just before sampled for it

    def execute(self, batch):
        if self.vocab_size and batch.tokens.size and int(batch.tokens.max()) >= self.vocab_size:
            raise IndexError(f"index {int(batch.tokens.max())} is out of bounds for the embedding of {self.vocab_size}")
        if self.delay and self.delays_left != 0:
            if self.delays_left is not None:
                self.delays_left -= 1
            time.sleep(self.delay)
        if self.script is not None:
            for nr in batch.new_requests:
                if self.script["trigger"] in self.tokenizer.decode(nr.prompt_token_ids.tolist()):
                    self.scripted[nr.req_id] = 0
            for rid in batch.finished_req_ids:
                self.scripted.pop(rid, None)
        previous, self.last_sampled = self.last_sampled, {}
        out = self.model.execute(_fed(batch, previous))
        for i, rid in enumerate(out.req_ids.tolist()):
            k = self.scripted.get(rid)
            if k is not None:
                ids = self.script["token_ids"]
                out.token_ids[i] = ids[min(k, len(ids) - 1)]
                self.scripted[rid] = k + 1
        self.last_sampled = dict(zip(out.req_ids.tolist(), out.token_ids.tolist()))
        return out

    def expert_stats(self) -> tuple[int, int]:
        return 3 * self.model.steps, self.model.steps  # a fixed 75% hit rate, to see it reach /metrics


def _fed(batch, previous: dict[int, int]):
    """The batch with each feed_sampled row's token taken from the step just before, as the real
    executor does on the device; a row that step did not sample for is a scheduler bug."""
    feed = batch.feed_sampled
    if feed is None or not feed.any():
        return batch
    tokens = batch.tokens.copy()
    qstart = np.concatenate([[0], np.cumsum(batch.query_lens)])
    for i in np.flatnonzero(feed).tolist():
        rid = int(batch.req_ids[i])
        if rid not in previous:
            raise ValueError(f"step {batch.step_id}: request {rid} is fed a token the step before did not sample")
        tokens[qstart[i]] = previous[rid]
    return msgspec.structs.replace(batch, tokens=tokens, feed_sampled=None)


def boot_paged_hash_model(cfg: WorkerBootConfig):
    spec = json.loads((Path(cfg.model) / "paged_hash_model.json").read_text())
    req = cfg.plan
    pages = req.num_pages or 256
    page_size = req.page_size or 16
    slots = spec.get("linear_state_slots", 0)
    mrr = req.max_running_requests or 64
    kv = KVPlan(
        page_size=page_size, pages=pages, sentinel_pages=1, tokens=pages * page_size, bytes_per_token=0, bytes=0
    )
    plan = Plan(
        budget_bytes=0,
        budget_derivation="test double",
        weights_bytes=0,
        weights_source="test double",
        workspace_bytes=0,
        workspace_source="test double",
        total_bytes=0,
        headroom_bytes=0,
        kv=kv,
        linear_state=LinearStatePlan(slots=slots, padding_slots=1 if slots else 0, bytes_per_slot=0, bytes=0),
        experts=ExpertPlan(slots=0, total=0, min_slots=0, bytes_per_slot=0, bytes=0),
        dtype="float32",
        max_running_requests=mrr,
        max_prefill_tokens=req.max_prefill_tokens or 8192,
        max_model_len=req.max_model_len or 512,
        host=HostPlan(
            expert_bank_bytes=0,
            expert_bank_format="plain",
            available_bytes=None,
            available_source="unknown",
            reserve_bytes=0,
        ),
    )
    model = PagedHashModel(pages, page_size, spec["vocab"], slots)
    script, tokenizer = spec.get("script"), None
    if script is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    executor = DelayedExecutor(
        model,
        spec.get("step_delay_s", 0.0),
        script,
        tokenizer,
        spec.get("vocab_size", 0),
        spec.get("delayed_steps"),
    )
    return executor, plan
