"""bench/workspace_slices.py's loop, on CPU with a stand-in for the CUDA profile: each step size measured at
each slice below it once, the largest step run with its mixers sliced as asked, the slice put back after."""

from __future__ import annotations

import torch
from tiny_models import tiny_model

from bench.workspace_slices import measure, slot_bytes
from ferry.plan.costs import MIXER_SLICE_TOKENS
from ferry.plan.planner import PlanRequest, resolve
from ferry.services.worker import forward_batch
from ferry.services.worker.dummy_weights import iter_dummy_tensors
from ferry.services.worker.late_bound_experts import LateBoundExperts
from ferry.services.worker.models import build_model
from ferry.services.worker.workspace_profile import largest_step, run_largest_step


def test_each_step_is_measured_at_each_slice_below_it_and_the_slice_is_put_back():
    _, spec = tiny_model("qwen3_5_moe")
    r = resolve(spec, PlanRequest(max_running_requests=3, max_model_len=256, dtype="float32"))
    experts = LateBoundExperts(spec.num_experts)
    model = build_model(spec, torch.float32, "cpu", experts)
    model.load_weights(iter_dummy_tensors(spec, torch.float32, "cpu", routed_experts=False), routed_experts=False)
    seen = []

    def profile(model, experts, spec, r, device):  # what profile_workspace_cuda runs, and what it saw
        step = largest_step(r)
        slices = forward_batch.ForwardBatch.from_step(step, r.page_size, "cpu").mixer_slices
        seen.append((r.max_prefill_tokens, forward_batch.MIXER_SLICE_TOKENS, [(a, b) for a, b, _ in slices]))
        run_largest_step(model, experts, spec, r, torch.device("cpu"))
        return 10 * slot_bytes(spec, r.dtype)

    rows = measure(model, experts, spec, r, [64, 128], [128, 48], profile)
    assert [(x["tokens"], x["slice_tokens"], x["slots"]) for x in rows] == [
        (64, 64, 10.0),
        (64, 48, 10.0),
        (128, 128, 10.0),
        (128, 48, 10.0),
    ]
    assert seen == [
        (64, 64, []),
        (64, 48, [(0, 32), (32, 64)]),
        (128, 128, []),
        (128, 48, [(0, 42), (42, 85), (85, 128)]),
    ]
    assert forward_batch.MIXER_SLICE_TOKENS == MIXER_SLICE_TOKENS
