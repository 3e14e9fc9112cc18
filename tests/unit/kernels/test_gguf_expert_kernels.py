"""The GGUF block kernels (every type of GGUF_KERNEL_TYPES: kernels/gguf_block_decode.py's in-register decode, read
by gguf_expert_gemv.py and gguf_expert_gemm.py) under TRITON_INTERPRET=1: the decode against the gguf package's
numpy dequantization, and the kernels against `quantized_expert_rows_reference`, which decodes the blocks with
kernels/gguf_blocks.py (held bit for bit to the same package by test_gguf_checkpoints.py): the cases of
interpreted_quantized_expert_kernels.py named by each block type (and a Q4_K_M layer's mix), one child process a
type, as the 256-value blocks (K-quants, IQ4_XS) make them slow to interpret."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hopper_compile import ROOT
from quantized_slots import GGUF_TEST_TYPES, gguf_fmt

CASE_NAMES = (
    "decode_is_the_gguf_packages",
    "pair_tiny_skipped_offset",
    "pair_ragged_two_steps",
    "grouped_tiny_several_blocks_of_one_slot",
    "grouped_ragged",
    "slot_window_with_block_starts",
    "bfloat16_within_rounding",
    "mistakes_are_detected",
    "bf16_rows_are_the_float32_rows_rounded_once",
    "epilogue_pair",
    "epilogue_grouped_bfloat16",
)
GROUPS = {gguf_fmt(t): [f"{gguf_fmt(t)}/{name}" for name in CASE_NAMES] for t in GGUF_TEST_TYPES}
GROUPS["gguf-mixed"] = ["gguf-mixed/q4_k_q6_k_pair", "gguf-mixed/q4_k_q6_k_grouped"]  # w13 Q4_K, w2 Q6_K


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_gguf_kernels_match_the_twin_under_the_interpreter(group):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("interpreted_quantized_expert_kernels.py")), f"{group}/"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout)
    assert sorted(results) == sorted(GROUPS[group]), "every case listed ran, and no other"
    failures = {name: failure for name, failure in results.items() if failure is not None}
    assert not failures, "\n".join(f"{name}:\n{failure}" for name, failure in failures.items())
