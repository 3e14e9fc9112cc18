"""The GPU-only bench scripts of bench/pending_gpu_run.sh, run with their defaults on this CPU machine,
get as far as the device check: their default model paths load and their flags parse, so a call on the
GPU (30 minutes a session) is not spent on a wrong default (expert_window.py's --config once named a
config.json where load_model_config takes the model's folder, and would have died there at once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the scripts measure on a GPU here")
@pytest.mark.parametrize(
    "script,args",
    [
        ("expert_window.py", []),
        ("ring_overlap.py", []),
        ("workspace_slices.py", []),
        # the runner's second model, past whose 40,960 positions the default was
        ("workspace_slices.py", ["--model", "tests/data/models/qwen3-30b-a3b"]),
    ],
)
def test_a_gpu_bench_script_reaches_its_device_check_with_its_defaults(script, args):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "CUDA" in run.stderr and "Traceback" not in run.stderr and "ConfigError" not in run.stderr, run.stderr
