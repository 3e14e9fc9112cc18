"""The GGUF block kernels (every type of GGUF_KERNEL_TYPES: kernels/gguf_block_decode.py's in-register decode, read
by gguf_expert_gemv.py and gguf_expert_gemm.py) under TRITON_INTERPRET=1: the decode against the gguf package's
numpy dequantization, and the kernels against `quantized_expert_rows_reference`, which decodes the blocks with
kernels/gguf_blocks.py (held bit for bit to the same package by test_gguf_checkpoints.py): the cases of
interpreted_quantized_expert_kernels.py named by each block type (and a Q4_K_M layer's mix; every case for the types
of FULL_TYPES, the decode and its wiring into both kernels for the rest), one child process a type, as the 256-value
blocks (K-quants, IQ4_XS) make them slow to interpret. And their sm_90 compiles."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hopper_compile import ROOT, compile_in_child
from quantized_slots import GGUF_TEST_TYPES, gguf_fmt

from ferry.kernels.gguf_block_decode import GGUF_KERNEL_TYPES

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
# every case for one 32-value and one 256-value type; the rest share those kernels' bodies and differ only by their
# in-register decode (`gguf_weights`), which their decode case holds bit for bit to the gguf package, so one pair and
# one grouped case each show the decode wired into both kernels (interpreting every case of every type took ~8 min of
# CPU, on one test worker)
FULL_TYPES = ("Q8_0", "Q4_K")
WIRING_CASES = ("decode_is_the_gguf_packages", "pair_tiny_skipped_offset", "grouped_tiny_several_blocks_of_one_slot")
EPILOGUE_CASES = ("epilogue_pair", "epilogue_grouped_bfloat16")  # MXFP4: gpt-oss's GGUF experts (biases, clamp)


def _cases(ggml_type: str) -> tuple[str, ...]:
    if ggml_type in FULL_TYPES:
        return CASE_NAMES
    return WIRING_CASES + (EPILOGUE_CASES if ggml_type == "MXFP4" else ())


GROUPS = {gguf_fmt(t): [f"{gguf_fmt(t)}/{name}" for name in _cases(t)] for t in GGUF_TEST_TYPES}
GROUPS["gguf-mixed"] = ["gguf-mixed/q4_k_q6_k_pair", "gguf-mixed/q4_k_q6_k_grouped"]  # w13 Q4_K, w2 Q6_K


def test_every_gguf_type_with_kernels_has_interpreted_cases():
    assert sorted(GGUF_TEST_TYPES) == sorted(GGUF_KERNEL_TYPES)


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_gguf_kernels_match_the_twin_under_the_interpreter(group):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("interpreted_quantized_expert_kernels.py")), *GROUPS[group]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a 256-value type takes ~1.5 min of CPU interpreted, far more wall time on a loaded box
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout)
    assert sorted(results) == sorted(GROUPS[group]), "every case listed ran, and no other"
    failures = {name: failure for name, failure in results.items() if failure is not None}
    assert not failures, "\n".join(f"{name}:\n{failure}" for name, failure in failures.items())


H200_MAX_SHARED = 227 * 1024  # dynamic shared memory one block may use on sm_90
# the one kernel that spills (triton 3.9's sm_90 compile): Q8_0's grouped gate/up over a window at the decode
# block, 16 bytes a thread (4 registers; not timed on a GPU yet): it may not spill more
SPILLS_MEASURED = {"_gguf_gate_up_kernel[Q8_0, bf16, BLOCK_M=16, WINDOWED=True]": 16}


# the types compiled a child each half (one child a type paid a process and Triton's import eleven times over)
COMPILE_HALVES = (
    tuple(GGUF_KERNEL_TYPES)[: len(GGUF_KERNEL_TYPES) // 2],
    tuple(GGUF_KERNEL_TYPES)[len(GGUF_KERNEL_TYPES) // 2 :],
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu compiles and runs the kernels for real")
@pytest.mark.parametrize("ggml_types", COMPILE_HALVES, ids=lambda types: "-".join(types))
def test_gguf_kernels_compile_for_hopper_without_spilling(ggml_types):
    """Each type's kernels compile for sm_90 (compile_gguf_expert_kernels.py, a child a type: the compiles are long)
    at the tiles and warps they launch with, and no thread spills: a weight's decode is a chain of byte loads and
    integer ops per weight of the tile, twice over in gate/up, and a spill would be a round trip to memory in
    every step of every expert."""
    results = compile_in_child("compile_gguf_expert_kernels.py", *ggml_types)
    for ggml_type in ggml_types:
        # grouped: gate/up and down at 4 variants each, down into bf16 rows at 2; pair: gate/up at 3 markings,
        # down; MXFP4 (gpt-oss's GGUF experts) also with biases and the clamped SwiGLU, grouped and pair
        of_type = [name for name in results if f"[{ggml_type}, bf16" in name]
        assert len(of_type) == 4 + 4 + 2 + 3 + 1 + (4 if ggml_type == "MXFP4" else 0), sorted(of_type)
    assert len(results) == sum(4 + 4 + 2 + 3 + 1 + (4 if t == "MXFP4" else 0) for t in ggml_types)
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["cubin"] and 0 <= r["shared"] <= H200_MAX_SHARED, (name, r)
        assert (r["stack"] or 0) <= SPILLS_MEASURED.get(name, 0), f"{name} spills {r['stack']} bytes a thread"
