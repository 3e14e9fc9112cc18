"""The CUDA path's kernel sequence, end to end on CPU: tiny models run with every dispatcher sent
to Triton (through the interpreter, in a child process: interpreted_model_parity.py) must match
transformers as the CPU path does (see test_model_parity.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CASES = [
    "qwen3_moe-norm_topk-gqa",
    "qwen3_5_moe-gated-partial-rotary",
    "qwen3_5_moe-mixer-slices",
    "glm4_moe-groups-bias-no-qk-norm",
    "glm4_moe-8e-4groups-qk-norm",
    "gpt_oss-window-sinks-biased-clamped",
    "qwen3_moe-norm_topk-gqa-fp8-kv",
    "qwen3_5_moe-gated-partial-rotary-fp8-kv",
    "gpt_oss-sliding-rings",
    "gemma4-two-shapes-keqv-gelu",
    "gemma4-sliding-rings",
    "gpt_oss-sliding-slices",
]


@pytest.fixture(scope="module")
def results():
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "FERRY_TRITON_ON_CPU": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(HERE)]),
    }
    proc = subprocess.run(
        [sys.executable, str(HERE / "interpreted_model_parity.py")],
        cwd=HERE.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_triton_path_matches_transformers(results, case):
    assert case in results, f"case {case} did not run"
    if results[case] is not None:
        pytest.fail(results[case], pytrace=False)


def test_every_case_the_script_runs_is_checked(results):
    assert sorted(results) == sorted(CASES)
