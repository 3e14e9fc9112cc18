"""The Triton grouped expert GEMM against its reference twin on CPU, through TRITON_INTERPRET=1
in a child process (see interpreted_grouped_expert_gemm.py for why), and the CPU dispatch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hopper_compile import ROOT, compile_in_child

from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_forward_reference

CASES = [
    "decode_one_token",
    "ragged_shapes_and_skipped_pairs",
    "several_blocks_of_one_slot",
    "host_aligned_rows",
    "slot_window_computes_one_chunk_at_its_staging_slots",
    "slot_window_with_block_starts",
    "slot_window_with_block_starts_skewed_loops",
    "a_window_outside_the_aligned_slots_is_refused",
    "tight_grid_with_max_distinct_slots",
    "bfloat16_within_rounding",
    "alignment_groups_pairs_by_slot",
    "pair_kernel_decode_one_token",
    "pair_kernel_ragged_skipped_offset",
    "pair_kernel_groups_give_the_same_bits",
    "rows_summed_in_k_order",
    "bf16_rows_are_the_float32_rows_rounded_once",
    "epilogue_grouped_float32",
    "epilogue_grouped_bfloat16",
    "epilogue_pair_float32",
    "epilogue_pair_bfloat16",
    "gelu_grouped_float32",
    "gelu_grouped_bfloat16",
    "gelu_pair_float32",
    "gelu_pair_bfloat16",
]


@pytest.fixture(scope="module")
def interpreted_results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("interpreted_grouped_expert_gemm.py"))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_the_reference_under_the_interpreter(interpreted_results, case):
    assert case in interpreted_results, f"case {case} did not run"
    failure = interpreted_results[case]
    if failure is not None:
        pytest.fail(failure, pytrace=False)


def _case(seed, tokens, top_k, hidden, inter, slots):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(slots, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(slots, hidden, inter, generator=g) * inter**-0.5
    topk = torch.stack([torch.randperm(slots, generator=g)[:top_k] for _ in range(tokens)])
    return x, topk, torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1), w13, w2


def test_dispatch_uses_the_reference_on_cpu():
    from ferry.kernels.grouped_expert_gemm import grouped_expert_forward

    x, topk, weights, w13, w2 = _case(4, 6, 2, 16, 8, 4)
    assert torch.equal(
        grouped_expert_forward(x, topk, weights, w13, w2), grouped_expert_forward_reference(x, topk, weights, w13, w2)
    )


def test_the_result_does_not_depend_on_slot_numbering():
    """The property the offload cache relies on: the same experts in other slots give the same bits."""
    x, topk, weights, w13, w2 = _case(5, 11, 4, 24, 16, 8)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(9))  # expert s now lives in slot perm[s]
    w13p, w2p = torch.empty_like(w13), torch.empty_like(w2)
    w13p[perm], w2p[perm] = w13, w2
    a = grouped_expert_forward_reference(x, topk, weights, w13, w2)
    b = grouped_expert_forward_reference(x, perm[topk], weights, w13p, w2p)
    assert torch.equal(a, b)


def test_host_alignment_equals_the_device_alignment():
    from ferry.kernels.align_pairs import align_pairs_by_slot, align_pairs_by_slot_host

    g = torch.Generator().manual_seed(7)
    for trial in range(40):
        tokens, top_k, slots = (
            int(torch.randint(1, 50, (1,), generator=g)),
            4,
            int(torch.randint(4, 30, (1,), generator=g)),
        )
        topk = torch.stack([torch.randperm(slots, generator=g)[:top_k] for _ in range(tokens)])
        topk[torch.rand(tokens, top_k, generator=g) < 0.3] = -1
        block_m = (1, 2, 16)[trial % 3]
        distinct = (
            int(torch.unique(topk[topk >= 0]).numel()) if trial % 2 else None
        )  # the tight grid, or the worst case
        device_pairs, device_blocks = align_pairs_by_slot(topk, slots, block_m, distinct)
        host_pairs, host_blocks = align_pairs_by_slot_host(topk.numpy(), block_m)
        real = int((device_blocks >= 0).sum())
        assert (device_blocks[real:] == -1).all() and host_blocks.size == real
        assert host_blocks.tolist() == device_blocks[:real].tolist()
        assert host_pairs.tolist() == device_pairs[: real * block_m].tolist()


H200_MAX_SHARED = 227 * 1024  # dynamic shared memory one block may use on sm_90


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, tests/gpu compiles and runs the kernels for real")
def test_kernels_compile_for_hopper():
    results = compile_in_child("compile_grouped_expert_gemm.py")
    # the plain kernels, then the quantized twins (the fp4 ones for nvfp4 and mxfp4), then (bf16) the down
    # kernels and the sum into bf16 rows, and (bf16) gpt-oss's biased clamped experts through the grouped and
    # pair kernels, plain and mxfp4, Gemma 4's gelu-tanh gate/up (grouped and pair) (the GGUF kernels:
    # test_gguf_expert_kernels.py)
    assert len(results) == 26 + 72 + 3 + 6 + 4 + 2 + 4  # (compile_grouped_expert_gemm.py)
    assert sum("rows bf16" in name for name in results) == 3 + 6
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["cubin"] and 0 <= r["shared"] <= H200_MAX_SHARED, (name, r)  # the row sum needs none
