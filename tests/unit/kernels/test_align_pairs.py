"""The alignment's Triton kernels (kernels/align_pairs.py) against their torch twin under TRITON_INTERPRET=1
in a child process (interpreted_align_pairs.py), compiled for Hopper, and the CPU dispatch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hopper_compile import ROOT, compile_in_child

CASES = [
    "random_shapes_both_dtypes_every_block_size",
    "several_tiles_rank_across_tiles",
    "tiles_grow_past_the_chunk",
    "tight_bound_and_one_slot",
    "a_slot_past_the_slots_is_left_out",
    "every_pair_left_out",
    "the_dispatch_takes_the_kernels_for_triton_tensors",
]


@pytest.fixture(scope="module")
def interpreted_results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "FERRY_TRITON_ON_CPU": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("interpreted_align_pairs.py"))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_the_kernels_give_the_twins_layout_bit_for_bit(interpreted_results, case):
    assert set(interpreted_results) == set(CASES)
    assert interpreted_results[case] == "ok", interpreted_results[case]


def test_cpu_tensors_take_the_torch_twin(monkeypatch):
    import ferry.kernels.align_pairs as g

    monkeypatch.setattr(g, "align_pairs_by_slot_triton", lambda *a, **k: pytest.fail("CPU took the Triton path"))
    topk = torch.tensor([[3, 1], [1, -1], [0, 3]])
    pairs, blocks, starts = g.align_pairs_by_slot(topk, 4, 2, None, block_starts=True)
    assert pairs.tolist() == [4, 6, 1, 2, 0, 5] + [6] * 8 and blocks.tolist() == [0, 1, 3, -1, -1, -1, -1]
    assert starts.tolist() == [0, 1, 2, 2, 3]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu compiles and runs the kernels for real")
def test_the_kernels_compile_for_hopper():
    results = compile_in_child("compile_align_pairs.py")
    assert len(results) == 6
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["cubin"] and r["stack"] in (0, None), (name, r)
