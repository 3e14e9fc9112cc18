"""Hybrid prefix reuse on a real GPU, in bf16: the worker booted as served (profiled workspace, decode graphs,
the snapshot pool allocated as priced), the real scheduler driving it in this process. A turn that starts
from a linear-state snapshot must decode what a full recompute decodes, up to bf16 noise: the same greedy
tokens until a near tie, and there the two runs' top choices a rounding apart. Skipped without CUDA."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from tests.helpers import cuda_test_budget

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOP = 5


def _engine(model_dir, prefix_cache: bool):
    from ferry.services.scheduler.batcher import BatchScheduler
    from ferry.services.worker.boot import boot_worker
    from ferry.services.worker.flags import add_worker_flags, boot_config_from_args
    from ferry.services.worker.service import pool_report_from_plan

    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    cfg = boot_config_from_args(
        parser.parse_args(
            [
                "--model",
                str(model_dir),
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
                "--gpu-memory",
                cuda_test_budget(2**30),
                "--max-running-requests",
                "4",
                "--max-prefill-tokens",
                "256",
                "--max-model-len",
                "512",
            ]
        )
    )
    executor, plan = boot_worker(cfg)
    assert plan.linear_state_snapshots.snapshots > 0
    return executor, BatchScheduler(pool_report_from_plan(plan, executor.vocab_size), prefix_cache=prefix_cache)


def _run(executor, sched, rid, prompt, n):
    """Greedy tokens and, per token, the top-TOP (ids, logprobs) it was chosen from; the request's cached tokens."""
    from ferry.shared.sampling import SamplingParams

    req = sched.add(rid, b"t", rid, np.array(prompt, np.int32), SamplingParams(temperature=0, logprobs=TOP), n)
    tokens, tops = [], []
    while (batch := sched.schedule()) is not None:
        out = sched.complete(executor.execute(batch))
        assert not out.failed
        tokens += [t for _, t in out.tokens]
        tops += [(lp.top_ids[0].tolist(), lp.top_logprobs[0].tolist()) for _, lp in out.logprobs]
    return tokens, tops, req.cached_tokens


def _agree_up_to_bf16_noise(a, b) -> None:
    (ta, _), (tb, pb) = a, b
    for i, (x, y) in enumerate(zip(ta, tb)):
        if x != y:  # a near tie: each run's choice is the other's runner-up, a rounding apart
            ids, lps = pb[i]
            assert x in ids[:2], f"token {i}: {x} is not among the recompute's top two {ids[:2]}"
            assert abs(lps[0] - lps[ids.index(x)]) < 0.1
            return


def test_a_turn_from_a_snapshot_decodes_as_a_full_recompute_in_bf16(tiny_models):
    model = tiny_models["qwen3_5_moe"]
    executor, sched = _engine(model, prefix_cache=True)
    first = [int(t) for t in np.random.default_rng(0).integers(5, 200, 150)]
    out1, _, _ = _run(executor, sched, 1, first, 20)
    second = first + out1 + [int(t) for t in np.random.default_rng(1).integers(5, 200, 40)]
    reused = _run(executor, sched, 2, second, 16)
    assert reused[2] >= 160  # the output's last page boundary: 150 + 20 tokens, the last not computed
    fresh_executor, fresh_sched = _engine(model, prefix_cache=False)
    fresh = _run(fresh_executor, fresh_sched, 1, second, 16)
    assert fresh[2] == 0
    _agree_up_to_bf16_noise(reused[:2], fresh[:2])
