"""The fused norm / rotary kernels compile for the H200 (sm_90) on a machine without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu compiles and runs the kernels for real")
def test_fused_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_fused_kernels.py"))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 14
    for name, r in results.items():
        assert "error" not in r and r["cubin"], f"{name}: {r}"
