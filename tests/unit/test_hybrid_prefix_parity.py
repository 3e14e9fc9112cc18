"""Hybrid prefix reuse against full recompute and transformers, float32 on CPU: the real scheduler and the real
executor in one process (no sockets), the pools allocated as the planner priced them, linear-state snapshots
saved and restored by the step's state copies. A greedy decode from a reused prefix must equal, token for
token, the one from a full recompute (`prefix_cache=False`) and transformers' on the same prompt: prompts
ending mid-page and on a page boundary, conversations extending a prompt or its output, after a deeper
snapshot was evicted, n > 1 choices, and requests preempted and resumed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_harness import hf_greedy
from tiny_models import tiny_model

from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.services.scheduler.batcher import BatchScheduler
from ferry.services.worker.executor import StepExecutor
from ferry.services.worker.models import build_model
from ferry.services.worker.offload.stores.resident import ResidentExperts
from ferry.services.worker.pools import allocate_pools
from ferry.services.worker.service import pool_report_from_plan
from ferry.shared.sampling import SamplingParams
from ferry.shared.units import MiB

ARCHS = ["qwen3_5_moe", "qwen3_next"]
PS = 16


class Engine:
    """What the served processes do per step, in one process: schedule, execute, complete."""

    def __init__(self, hf, spec, pages=48, snapshots=None, prefix_cache=True, running=4, prefill=64):
        req = PlanRequest(
            gpu_memory=512 * MiB,
            num_pages=pages,
            page_size=PS,
            max_running_requests=running,
            max_prefill_tokens=prefill,
            max_model_len=512,
            dtype="float32",
            linear_state_snapshots=snapshots,
        )
        self.plan = make_plan(spec, req, Measured(weights_bytes=0, workspace_bytes=0))
        pools = allocate_pools(spec, self.plan, "cpu")
        experts = ResidentExperts(pools.experts, len(spec.moe_layer_indices), spec.num_experts)
        model = build_model(spec, torch.float32, "cpu", experts)
        model.load_weights(hf.state_dict().items())
        self.executor = StepExecutor(model, pools, spec, self.plan, "cpu")
        self.sched = BatchScheduler(pool_report_from_plan(self.plan, spec.vocab_size), prefix_cache=prefix_cache)
        self.computed = 0  # tokens the model computed
        self.saved_inside = 0  # snapshots kept inside a row's chunk (StepBatch.save_offset)
        self.rid = 0

    def run(self, prompts: list[list[int]], n: int) -> list[tuple[list[int], int]]:
        """Greedy continuations of `prompts`, submitted together: [(tokens, cached_tokens)]."""
        reqs = []
        for p in prompts:
            self.rid += 1
            reqs.append(
                self.sched.add(self.rid, b"t", self.rid, np.array(p, np.int32), SamplingParams(temperature=0), n)
            )
        got: dict[int, list[int]] = {r.rid: [] for r in reqs}
        while (batch := self.sched.schedule()) is not None:
            self.computed += len(batch.tokens)
            if batch.save_offset is not None:
                self.saved_inside += int(((batch.save_state >= 0) & (batch.save_offset < batch.query_lens)).sum())
            out = self.sched.complete(self.executor.execute(batch))
            assert not out.failed, out.failed
            for r, t in out.tokens:
                got[r.rid].append(t)
        assert not (self.sched.running or self.sched.waiting)
        return [(got[r.rid], r.cached_tokens) for r in reqs]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, seed=11)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _same_as_recompute_and_transformers(model, prompt: list[int], tokens: list[int]) -> None:
    hf, spec = model
    fresh = Engine(hf, spec, prefix_cache=False).run([prompt], len(tokens))[0]
    assert fresh == (tokens, 0), "reuse and full recompute disagree"
    assert hf_greedy(hf, prompt, len(tokens))[0] == tokens, "reuse and transformers disagree"


@pytest.mark.parametrize("length", [37, 32], ids=["mid-page", "page-boundary"])
def test_a_conversation_from_its_snapshots_equals_full_recompute_and_transformers(model, length):
    hf, spec = model
    engine = Engine(hf, spec)
    first = _prompt(length, 1)
    ((out1, cached1),) = engine.run([first], 12)
    assert cached1 == 0
    # mid-page, the prompt-end snapshot (16) is kept inside the prompt's one step, by the linear layers
    assert engine.saved_inside == (1 if length == 37 else 0)
    # the next turn extends the prompt and its output (where the output's last snapshot is)
    second = first + out1 + _prompt(9, 2)
    ((out2, cached2),) = engine.run([second], 8)
    assert cached2 == (length + 12 - 1) // PS * PS
    _same_as_recompute_and_transformers(model, second, out2)
    # another turn extends the first prompt only: it starts from that prompt's snapshot (the last page boundary
    # 8 tokens before its end: 16 for 37 tokens; for 32, the end of its last chunk, 32)
    other = first + _prompt(7, 3)
    ((out3, cached3),) = engine.run([other], 8)
    assert cached3 == (32 if length == 32 else 16)
    _same_as_recompute_and_transformers(model, other, out3)


def test_after_the_deeper_snapshot_is_evicted_a_request_starts_from_a_shallower_one(model):
    hf, spec = model
    engine = Engine(hf, spec, snapshots=3, prefill=16)
    first = _prompt(40, 4)
    engine.run([first], 4)  # snapshots at 16 (a chunk's end) and 32 (the prompt's last page boundary)
    assert engine.sched.snapshots.held == 2
    engine.run([first[:20] + _prompt(6, 5)], 8)  # starts from 16 (used again: now more recent than 32)
    engine.run([_prompt(20, 6)], 2)  # needs an id: the least recently used, 32, goes
    assert engine.sched.snapshots.evictions == 1
    extended = first + _prompt(6, 7)
    ((tokens, cached),) = engine.run([extended], 8)
    assert cached == 16
    _same_as_recompute_and_transformers(model, extended, tokens)


def test_n_choices_compute_the_prompt_once_and_agree(model):
    hf, spec = model
    engine = Engine(hf, spec)
    p = _prompt(37, 8)
    results = engine.run([p, p, p], 6)
    assert [c for _, c in results] == [0, 16, 16]  # from the first one's prompt-end snapshot
    assert engine.computed == 37 + 2 * 21 + 3 * 5  # the prompt once, the others' tails, the decodes
    assert results[0][0] == results[1][0] == results[2][0]
    _same_as_recompute_and_transformers(model, p, results[0][0])


def test_preempted_requests_resume_from_their_snapshots_and_agree(model):
    hf, spec = model
    engine = Engine(hf, spec, pages=9)  # 144 tokens of KV for 4 x (30 + 30)
    prompts = [_prompt(30, 20 + i) for i in range(4)]
    results = engine.run(prompts, 30)
    assert engine.sched.preemptions > 0 and engine.sched.prefix_hits > 0
    for p, (tokens, _) in zip(prompts, results):
        assert tokens == hf_greedy(hf, p, 30)[0]
