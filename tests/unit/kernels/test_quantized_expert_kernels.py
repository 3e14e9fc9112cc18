"""The quantized expert kernels (NVFP4, MXFP4, FP8-block; quantized_expert_gemv.py, quantized_expert_gemm.py; the GGUF
ones' interpreted cases: test_gguf_expert_kernels.py)
against `quantized_expert_rows_reference` under TRITON_INTERPRET=1 in a child process
(interpreted_quantized_expert_kernels.py; interpreted_grouped_expert_gemm.py says why), the reference
against the formats' formulas element by element, and the CPU dispatch. Their sm_90 compile is
test_grouped_expert_gemm.py's, with the plain kernels'."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hopper_compile import ROOT
from quantized_slots import gguf_fmt, make_experts, make_family

from ferry.kernels.grouped_expert_gemm import grouped_expert_forward
from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_forward_reference
from ferry.kernels.quantized_expert_gemv import check_quantized_families
from ferry.kernels.quantized_experts import E2M1_VALUES, FP8_BLOCK, MXFP4, NVFP4, dequantize_slot

CASES = [
    f"{fmt}/{name}"
    for fmt in (NVFP4, MXFP4, FP8_BLOCK)
    for name in (
        "pair_tiny_skipped_offset",
        "pair_i_not_a_multiple_of_128",
        "pair_ragged_two_steps",
        "grouped_tiny_several_blocks_of_one_slot",
        "grouped_i_not_a_multiple_of_128",
        "grouped_ragged",
        "host_aligned_rows",
        "slot_window_computes_one_chunk_at_its_staging_slots",
        "slot_window_with_block_starts",
        "slot_window_with_block_starts_skewed_loops",
        "tight_grid_with_max_distinct_slots",
        "bfloat16_within_rounding",
        "mistakes_are_detected",
        "bf16_rows_are_the_float32_rows_rounded_once",
    )
]
CASES += [
    f"{fmt}/{name}"
    for fmt in (NVFP4, MXFP4)  # the fp4 kernels compute gpt-oss's epilogue (biases, the clamped SwiGLU)
    for name in ("epilogue_pair", "epilogue_grouped", "epilogue_pair_bfloat16", "epilogue_grouped_bfloat16")
]
CASES += [f"{NVFP4}/gelu_pair", f"{NVFP4}/gelu_grouped_bfloat16"]  # Gemma 4's gelu-tanh experts in nvfp4


@pytest.fixture(scope="module")
def interpreted_results():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("interpreted_quantized_expert_kernels.py"))],
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
def test_quantized_kernels_match_the_reference_under_the_interpreter(interpreted_results, case):
    assert case in interpreted_results, f"case {case} did not run"
    failure = interpreted_results[case]
    if failure is not None:
        pytest.fail(failure, pytrace=False)


def test_every_case_is_listed(interpreted_results):
    assert sorted(interpreted_results) == sorted(CASES)


def _fp8_e4m3(byte: int) -> float:
    sign, exponent, mantissa = byte >> 7, (byte >> 3) & 15, byte & 7
    value = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -value if sign else value


def _e2m1(code: int) -> float:
    return -E2M1_VALUES[code & 7] if code & 8 else E2M1_VALUES[code & 7]


def test_the_reference_dequantizes_as_the_formats_say():
    """dequantize_slot, the kernels' twin, against the formulas of kernels/quantized_experts.py read
    straight off the bytes, one element at a time: nibble order, group and block indexing (w13's
    row blocks restarting at up's first row, partial blocks at both edges) and the scales' roles."""
    g = torch.Generator().manual_seed(3)
    nv = make_family(NVFP4, 6, 48, 3, 2, g)
    q, scale = nv.q.view(torch.uint8), nv.scale.view(torch.uint8)
    for slot in range(2):
        got = dequantize_slot(nv, slot, torch.float32)
        for o in range(6):
            for i in range(48):
                code = (int(q[slot, o, i // 2]) >> (4 * (i % 2))) & 15  # element 2j low nibble, 2j + 1 high
                want = _e2m1(code) * _fp8_e4m3(int(scale[slot, o, i // 16]))
                want = float(torch.tensor(want, dtype=torch.float32) * nv.gscale[slot, o])
                assert float(got[o, i]) == want, (slot, o, i)
    part_rows = 130  # two row blocks a part, the second of 2 rows
    fp8 = make_family(FP8_BLOCK, 2 * part_rows, 136, part_rows, 1, g)
    q8 = fp8.q.view(torch.uint8)
    got = dequantize_slot(fp8, 0, torch.float32)
    assert tuple(fp8.scale.shape) == (1, 4, 2)
    for o in range(0, 2 * part_rows, 3):
        row_block = (o // part_rows) * 2 + (o % part_rows) // 128
        for i in range(0, 136, 5):
            want = torch.tensor(_fp8_e4m3(int(q8[0, o, i])), dtype=torch.float32) * fp8.scale[0, row_block, i // 128]
            assert float(got[o, i]) == float(want), (o, i)


def test_the_mxfp4_reference_is_transformers_dequantizer():
    """dequantize_slot of mxfp4 slots (the kernels' twin) gives, bit for bit, what transformers' own gpt-oss
    dequantizer (`convert_moe_packed_tensors`) makes of the same blocks and scales, every e8m0 byte included."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(4)
    mx = make_family(MXFP4, 8, 256, 4, 2, g)
    mx.scale[1].view(-1).copy_(torch.arange(1, 65, dtype=torch.uint8) * 3)  # bytes 3 .. 192: far from 127
    for slot in range(2):
        blocks = mx.q[slot].reshape(8, 8, 16)  # gpt-oss's [O, IN/32, 16]
        want = convert_moe_packed_tensors(blocks[None], mx.scale[slot][None], dtype=torch.float32)[0].T
        assert torch.equal(dequantize_slot(mx, slot, torch.float32), want)


def test_cpu_dispatch_computes_quantized_slots_with_the_reference():
    """On CPU `grouped_expert_forward` takes the reference, which computes quantized slots as the plain
    reference computes their dequantized weights (same bits)."""
    for fmt in (NVFP4, MXFP4, FP8_BLOCK):
        g = torch.Generator().manual_seed(5)
        w13, w2 = make_experts(fmt, 64, 32, 5, g)
        x = torch.randn(7, 64, generator=g)
        topk = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(7)])
        topk[3, 1] = -1
        weights = torch.softmax(torch.randn(7, 2, generator=g), dim=-1)
        dense13 = torch.stack([dequantize_slot(w13, s, x.dtype) for s in range(5)])
        dense2 = torch.stack([dequantize_slot(w2, s, x.dtype) for s in range(5)])
        assert torch.equal(
            grouped_expert_forward(x, topk, weights, w13, w2),
            grouped_expert_forward_reference(x, topk, weights, dense13, dense2),
        )


def test_families_that_do_not_fit_are_refused():
    g = torch.Generator().manual_seed(6)
    w13, w2 = make_experts(FP8_BLOCK, 64, 32, 2, g)
    assert check_quantized_families(64, w13, w2) == 32
    with pytest.raises(ValueError, match="do not fit"):
        check_quantized_families(48, w13, w2)
    with pytest.raises(ValueError, match="one format"):
        check_quantized_families(64, w13, make_experts(NVFP4, 64, 32, 2, g)[1])
    with pytest.raises(ValueError, match="do not fit"):  # w2 in place of w13
        check_quantized_families(64, w2, w2)


def test_gguf_families_without_kernels_or_whole_blocks_are_refused():
    """GGUF w13 and w2 may be of different types (a gguf-mixed layer), each one the kernels read, in whole blocks;
    a type without kernels, or a GGUF family beside another format, is refused by name."""
    import dataclasses

    g = torch.Generator().manual_seed(7)
    w13, _ = make_experts(gguf_fmt("Q4_K"), 256, 256, 2, g)
    _, w2 = make_experts(gguf_fmt("Q6_K"), 256, 256, 2, g)
    assert check_quantized_families(256, w13, w2) == 256
    with pytest.raises(ValueError, match="no Triton kernel reads GGUF Q2_K blocks"):  # no Ferry format holds Q2_K
        check_quantized_families(256, w13, dataclasses.replace(w2, ggml_type="Q2_K"))
    with pytest.raises(ValueError, match="or GGUF blocks"):
        check_quantized_families(256, w13, make_experts(MXFP4, 256, 256, 2, g)[1])
    q8_13, q8_2 = make_experts(gguf_fmt("Q8_0"), 64, 32, 2, g)
    assert check_quantized_families(64, q8_13, q8_2) == 32
    with pytest.raises(ValueError, match="whole blocks"):  # Q8_0 rows of 32 values under Q4_K's 256 of w13
        check_quantized_families(64, dataclasses.replace(q8_13, ggml_type="Q4_K"), q8_2)
