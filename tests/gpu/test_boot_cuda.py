"""Boot on a real GPU: measured weights, a profiled workspace, pools as planned, the budget kept,
and the same greedy tokens as transformers. Skipped without CUDA."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.helpers import CUDA_TEST_PROCESS_BYTES, cuda_test_budget

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _args(model_dir, *extra):
    from ferry.services.worker.flags import add_worker_flags, boot_config_from_args

    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    return boot_config_from_args(
        parser.parse_args(
            [
                "--model",
                str(model_dir),
                "--device",
                "cuda",
                "--max-running-requests",
                "8",
                "--max-prefill-tokens",
                "256",
                *extra,
            ]
        )
    )


def test_cuda_boot_measures_profiles_and_keeps_the_budget(tiny_model):
    from ferry.services.worker.boot import boot_worker

    budget = 512 * 2**20
    torch.cuda.empty_cache()
    # what the process already holds is not this boot's: e.g. the cuBLAS workspace of the graph
    # capture stream, which an earlier boot in this process made and torch keeps for the process
    held_before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    executor, plan = boot_worker(_args(tiny_model, "--gpu-memory", cuda_test_budget(budget)))
    assert plan.weights_source == "measured" and plan.workspace_source.startswith("profiled")
    assert plan.workspace_bytes > 0
    assert executor.pools.nbytes == (
        plan.kv.bytes + plan.linear_state.bytes + plan.linear_state_snapshots.bytes + plan.experts.bytes
    )
    # the promise: what this boot reserved, and all the process holds outside the allocator, within --gpu-memory
    assert torch.cuda.max_memory_reserved() - held_before <= budget + CUDA_TEST_PROCESS_BYTES


def test_cuda_greedy_matches_transformers(tiny_model, capsys):
    import json

    from transformers import AutoModelForCausalLM

    from ferry.services.cli import main

    prompt_ids = [5, 17, 33, 2, 8, 100, 41, 9]
    argv = [
        "generate",
        "--model",
        str(tiny_model),
        "--device",
        "cuda",
        "--gpu-memory",
        cuda_test_budget(512 * 2**20),
        "--prompt-ids",
        ",".join(map(str, prompt_ids)),
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).cuda().eval()
    ids = torch.tensor([prompt_ids], device="cuda")
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    assert result["token_ids"] == ids[0, len(prompt_ids) :].tolist()
