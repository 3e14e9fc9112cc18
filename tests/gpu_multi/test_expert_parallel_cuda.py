"""Issue 26 on two GPUs (`make gpu-check-multi`): the tiny models served with `--expert-parallel-size 2`
(rank g on cuda:g, NCCL between them) complete greedily and with a seed exactly as one GPU holding every
expert, in float32, and unseeded sampling stays in step on both ranks. Skipped without two GPUs; the same
checks on CPU ranks over gloo are tests/integration/test_expert_parallel_serve.py."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_expert_parallel_serve import assert_two_ranks_serve_as_one

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

FLAGS = [
    "--device",
    "cuda",
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--moe-cache-size",
    "10",
    "--gpu-memory",
    "4GiB",
]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_two_gpus_serve_as_one(tiny_models, tmp_path, arch):
    assert_two_ranks_serve_as_one(tiny_models[arch], tmp_path, FLAGS, ready_timeout=300)
