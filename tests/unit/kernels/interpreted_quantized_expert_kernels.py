"""Cases for the quantized expert kernels (NVFP4, MXFP4, FP8-block, GGUF blocks) under TRITON_INTERPRET=1, run in a
child process by test_quantized_expert_kernels.py (interpreted_grouped_expert_gemm.py says why). Each
kernel is reached through the plain entry points' dispatch and compared with
`quantized_expert_rows_reference`; outputs poisoned first."""

from __future__ import annotations

import json
import os
import sys
import traceback
from unittest import mock

import torch
import triton
import triton.language as tl

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

from tests.triton_interpreter_patch import install as install_interpreter_patch  # noqa: E402

install_interpreter_patch()

from long_step_rows import bf16_rows_are_the_float32_rows_rounded_once  # noqa: E402
from quantized_slots import GGUF_TEST_TYPES, gguf_fmt, make_experts  # noqa: E402

import ferry.kernels.gguf_blocks as gguf_blocks  # noqa: E402
import ferry.kernels.grouped_expert_gemm_reference as reference  # noqa: E402
import ferry.kernels.quantized_experts as qe  # noqa: E402
from ferry.kernels.align_pairs import align_pairs_by_slot, align_pairs_by_slot_host  # noqa: E402
from ferry.kernels.aligned_blocks import block_m_for, launch_blocks  # noqa: E402
from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton  # noqa: E402
from ferry.kernels.gguf_block_decode import GGUF_KERNEL_TYPES, gguf_tile, gguf_weights  # noqa: E402
from ferry.kernels.grouped_expert_gemm import grouped_expert_rows_triton  # noqa: E402
from ferry.kernels.grouped_expert_gemm_reference import quantized_expert_rows_reference  # noqa: E402
from ferry.kernels.quantized_experts import FP4_SCALES, FP8_BLOCK, MXFP4, NVFP4, QuantizedFamily  # noqa: E402

TIGHT = dict(rtol=1e-5, atol=1e-5)  # float32 x: only the order of the float32 sums differs
BF16 = dict(rtol=2e-2, atol=2e-2)  # as the plain kernels' bf16 cases


# GGUF formats with kernels (kernels/gguf_block_decode.py), as the tests name them (quantized_slots.py)
GGUF = [gguf_fmt(t) for t in GGUF_TEST_TYPES]
# the small cases' (H, I): whole blocks of each format (a K-quant's or IQ4_XS's block holds 256 values)
SMALL = {gguf_fmt(t): (256, 256) for t in GGUF_TEST_TYPES if gguf_blocks.BLOCKS[t][0] == 256}


def small(fmt):
    return SMALL.get(fmt, (64, 32))


def make_case(fmt, seed, tokens, top_k, hidden, inter, slots, dtype=torch.float32, skip=0):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = make_experts(fmt, hidden, inter, slots, g, exact_bf16=dtype == torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    topk = torch.stack([torch.randperm(slots, generator=g)[:top_k] for _ in range(tokens)])
    for _ in range(skip):  # some pairs skipped (slot -1), as when a layer is computed in groups
        topk[torch.randint(tokens, (1,), generator=g), torch.randint(top_k, (1,), generator=g)] = -1
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return x, topk, weights, w13, w2


def nan_rows(x, topk):
    return torch.full((*topk.shape, x.shape[1]), float("nan"))


def reference_rows(x, topk, weights, w13, w2):
    want = nan_rows(x, topk)
    quantized_expert_rows_reference(x, topk, weights, w13, w2, want)
    return want


def assert_rows(got, want, topk, tol=TIGHT):
    skipped = topk < 0
    assert torch.isnan(got[skipped]).all(), "skipped pairs must be left untouched"
    assert not torch.isnan(got[~skipped]).any(), "every routed pair must be written"
    torch.testing.assert_close(got[~skipped], want[~skipped], **tol)


def pair_kernel_matches(fmt, seed, tokens, top_k, hidden, inter, slots, skip, offset):
    """Pair by pair: ragged shapes, skipped pairs untouched, and the all-resident store's slot offset."""
    x, topk, weights, w13, w2 = make_case(fmt, seed, tokens, top_k, hidden, inter, slots + offset, skip=skip)
    topk = torch.where(topk >= 0, topk % slots, -1)  # ids of one "layer"; its slots start at offset
    got = nan_rows(x, topk)
    expert_pair_rows_triton(x, topk, weights, w13, w2, got, slot_offset=offset)
    assert_rows(got, reference_rows(x, torch.where(topk >= 0, topk + offset, -1), weights, w13, w2), topk)


def grouped_kernel_matches(fmt, seed, tokens, top_k, hidden, inter, slots, skip):
    x, topk, weights, w13, w2 = make_case(fmt, seed, tokens, top_k, hidden, inter, slots, skip=skip)
    got = nan_rows(x, topk)
    grouped_expert_rows_triton(x, topk, weights, w13, w2, got)
    assert_rows(got, reference_rows(x, topk, weights, w13, w2), topk)


def host_aligned_rows_match(fmt):
    """The offload store's way: alignment made on the host; topk_slots must not be read."""
    x, topk, weights, w13, w2 = make_case(fmt, 6, 40, 3, 64, 32, 9, skip=7)
    sorted_pairs, block_slot = align_pairs_by_slot_host(topk.numpy(), block_m_for(topk.numel()))
    got = nan_rows(x, topk)
    grouped_expert_rows_triton(
        x,
        torch.full_like(topk, 10**6),
        weights,
        w13,
        w2,
        got,
        aligned=(torch.from_numpy(sorted_pairs), torch.from_numpy(block_slot)),
    )
    assert_rows(got, reference_rows(x, topk, weights, w13, w2), topk)


def copy_slots(dst: QuantizedFamily, start: int, src: QuantizedFamily, lo: int, hi: int) -> None:
    """What a copy into slots does: each part's bytes of slots lo..hi-1 into dst's slots from start."""
    for name in ("q", "scale", "gscale"):
        d, s = getattr(dst, name), getattr(src, name)
        if s is not None:
            d[start : start + hi - lo] = s[lo:hi]


def poison(family: QuantizedFamily) -> None:
    """NaN scales (e8m0: 255, inf; GGUF blocks: every byte 255, so each block's fp16 d is NaN): a weight read
    from a stale slot turns its result NaN or inf."""
    if family.ggml_type is not None:
        family.q.fill_(255)
        return
    family.scale.fill_(255 if family.scale.dtype == torch.uint8 else float("nan"))
    if family.gscale is not None:
        family.gscale.fill_(float("nan"))


def slot_window_computes_one_chunk_at_its_staging_slots(fmt, block_starts=False, skewed=False):
    """The streamed prefill's way (as the plain case): 9 experts in chunks of 4, each chunk's weights
    in a bay of a 6-slot staging family, computed through a slot window; each pair exactly once.
    `block_starts`: each chunk's launch sized for its own blocks; `skewed`: every token's first pair on
    position 0, whose chunk then loops over more blocks than it has programs (the plain case says more)."""
    hidden, inter = small(fmt)
    x, topk, weights, w13, w2 = make_case(fmt, 14, 40, 3, hidden, inter, 9, skip=0 if skewed else 5)
    if skewed:
        g = torch.Generator().manual_seed(15)
        topk = torch.stack(
            [torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(8, generator=g)[:2]]) for _ in range(40)]
        )
    block_m = block_m_for(topk.numel())
    aligned = align_pairs_by_slot(topk, 9, block_m, 9, block_starts=block_starts)
    if skewed:
        assert int(aligned[2][4] - aligned[2][0]) > launch_blocks(aligned, topk.numel(), block_m, (0, 4, 2))[3]
    want = reference_rows(x, topk, weights, w13, w2)
    bay13, bay2 = make_experts(fmt, hidden, inter, 6, torch.Generator().manual_seed(1))
    poison(bay13)
    poison(bay2)
    got = nan_rows(x, topk)
    for lo, hi, bay in ((0, 4, 2), (4, 8, 0), (8, 9, 1)):  # positions [lo, hi) land in slots bay..bay+hi-lo
        copy_slots(bay13, bay, w13, lo, hi)
        copy_slots(bay2, bay, w2, lo, hi)
        grouped_expert_rows_triton(x, None, weights, bay13, bay2, got, aligned=aligned, slot_window=(lo, hi, bay - lo))
        poison(bay13)
        poison(bay2)
    assert_rows(got, want, topk)


def tight_grid_with_max_distinct_slots(fmt):
    x, _, weights, w13, w2 = make_case(fmt, 8, 40, 2, 64, 32, 30)
    g = torch.Generator().manual_seed(8)
    used = torch.randperm(30, generator=g)[:3]
    topk = torch.stack([used[torch.randperm(3, generator=g)[:2]] for _ in range(40)])
    got = nan_rows(x, topk)
    grouped_expert_rows_triton(x, topk, weights, w13, w2, got, max_distinct_slots=3)
    assert_rows(got, reference_rows(x, topk, weights, w13, w2), topk)


def bfloat16_within_rounding(fmt):
    """bf16 x: both kernels within rounding of the reference (the plain cases' shape and tolerance; the
    interpreter rounds toward zero, so larger shapes drift further; the weights are exact in bf16, see
    make_family), and the pair kernel computing a layer in two groups gives the bits it gives at
    once (what lets an offloading store agree with a resident one)."""
    x, topk, weights, w13, w2 = make_case(fmt, 3, 9, 2, *small(fmt), 5, dtype=torch.bfloat16)
    want = reference_rows(x, topk, weights, w13, w2).sum(dim=1).to(torch.bfloat16).float()
    for kernel in (grouped_expert_rows_triton, expert_pair_rows_triton):
        got = nan_rows(x, topk)
        kernel(x, topk, weights, w13, w2, got)
        torch.testing.assert_close(got.sum(dim=1).to(torch.bfloat16).float(), want, **BF16)
    x, topk, weights, w13, w2 = make_case(fmt, 11, 2, 4, 160, 96, 9, dtype=torch.bfloat16)
    at_once = nan_rows(x, topk)
    expert_pair_rows_triton(x, topk.to(torch.int32), weights, w13, w2, at_once)
    first = torch.rand(2, 4, generator=torch.Generator().manual_seed(1)) < 0.5
    in_groups = nan_rows(x, topk)
    expert_pair_rows_triton(x, torch.where(first, topk, -1), weights, w13, w2, in_groups)
    expert_pair_rows_triton(x, torch.where(first, -1, topk), weights, w13, w2, in_groups)
    assert torch.equal(at_once, in_groups)


def _gguf_wrongly(family, slot, dtype, mistake):
    """GGUF blocks decoded with one mistake a kernel could make: each block's fp16 fields read as bfloat16 (their
    bytes' high half; MXFP4: its e8m0 byte off by one), or the blocks read at a stride one byte short (each row's
    bytes shifted under the decoder)."""
    q = family.q[slot]
    _, size = gguf_blocks.BLOCKS[family.ggml_type]
    if mistake == "block stride one byte short":
        q = torch.cat((q[:, 1:], q[:, :1]), dim=1)  # block b read at b * size + 1: as if each stride were size - 1
    if mistake == "d read as bf16":
        blocks = q.reshape(q.shape[0], -1, size).clone()
        for offset, _unit in GGUF_TEST_TYPES[family.ggml_type]:
            as_bf16 = blocks[:, :, offset : offset + 2].contiguous().view(torch.bfloat16).float()
            blocks[:, :, offset : offset + 2] = as_bf16.to(torch.float16).view(torch.uint8).view(*blocks.shape[:2], 2)
        q = blocks.reshape(q.shape)
    if mistake == "e8m0 bias off by one":  # MXFP4: each block's scale read twice as large
        blocks = q.reshape(q.shape[0], -1, size).clone()
        blocks[:, :, 0] += 1
        q = blocks.reshape(q.shape)
    return gguf_blocks.dequantize_rows(q, family.ggml_type, dtype)


def _dequantize_wrongly(mistake):
    """`dequantize_slot` with one mistake a kernel could make."""

    def dequantize(family, slot, dtype):
        if family.ggml_type is not None:
            return _gguf_wrongly(family, slot, dtype, mistake)
        if family.fmt == MXFP4:
            q = family.q[slot]
            if mistake == "nibbles swapped":
                q = (q << 4) | (q >> 4)
            s = family.scale[slot].to(torch.int32) - (126 if mistake == "scale bias 126" else qe.E8M0_BIAS)
            s = -s if mistake == "scale divided" else s
            scale = torch.exp2(s.to(torch.float32)).repeat_interleave(qe.MXFP4_GROUP, dim=1)
            return (qe.e2m1_decode(qe.unpack_nibbles(q)) * scale).to(dtype)
        if family.fmt == NVFP4:
            q = family.q[slot]
            if mistake == "nibbles swapped":
                q = (q << 4) | (q >> 4)
            values = qe.e2m1_decode(qe.unpack_nibbles(q))
            scale = family.scale[slot].to(torch.float32).repeat_interleave(qe.NVFP4_GROUP, dim=1)
            scale = 1 / scale if mistake == "scale divided" else scale
            return (values * scale * family.gscale[slot][:, None]).to(dtype)
        part_rows = family.rows if mistake == "blocks not restarted at each part" else family.part_rows
        blocks = family.scale[slot][qe.row_block_index(family.rows, part_rows)]
        scale = blocks.repeat_interleave(qe.FP8_BLOCK_SIZE, dim=1)[:, : family.cols]
        scale = 1 / scale if mistake == "scale divided" else scale
        return (family.q[slot].to(torch.float32) * scale).to(dtype)

    return dequantize


def mistakes_are_detected(fmt):
    """The comparisons are sensitive: a reference with the nibbles swapped, the scale divided instead of
    multiplied, (MXFP4) the e8m0 bias off by one, or (FP8) w13's row blocks not restarting at up's first
    row is far from the kernels."""
    x, topk, weights, w13, w2 = make_case(fmt, 17, 2 if fmt in SMALL else 3, 2, *small(fmt), 4)
    pair, grouped = nan_rows(x, topk), nan_rows(x, topk)
    expert_pair_rows_triton(x, topk, weights, w13, w2, pair)
    grouped_expert_rows_triton(x, topk, weights, w13, w2, grouped)
    want = reference_rows(x, topk, weights, w13, w2)
    torch.testing.assert_close(pair, want, **TIGHT)
    torch.testing.assert_close(grouped, want, **TIGHT)
    if fmt in GGUF:
        scaled_by_fp16 = GGUF_TEST_TYPES[fmt[5:].upper()]
        mistakes = ["block stride one byte short", "d read as bf16" if scaled_by_fp16 else "e8m0 bias off by one"]
    else:
        mistakes = ["scale divided"]
        mistakes += ["nibbles swapped"] if fmt in FP4_SCALES else ["blocks not restarted at each part"]
        mistakes += ["scale bias 126"] if fmt == MXFP4 else []
    for mistake in mistakes:
        with mock.patch.object(reference, "dequantize_slot", _dequantize_wrongly(mistake)):
            wrong = reference_rows(x, topk, weights, w13, w2)
        for name, got in (("pair", pair), ("grouped", grouped)):
            # a wrong reference may decode NaN (GGUF bytes read as fp16 at a wrong stride): as far as can be
            error = ((got - wrong).abs() / (wrong.abs() + 1e-3)).nan_to_num(nan=float("inf")).max().item()
            assert error > 0.1, f"{name} kernel within {error:.2g} of a reference with {mistake}"


def epilogue_rows_match(fmt, kernel, dtype, gelu=False):
    """gpt-oss's experts in an fp4 format: float32 biases (rounded to x's dtype where added) and the clamped
    SwiGLU at a limit the projections reach (or, `gelu`, Gemma 4's: no biases, gelu-tanh), through the pair or
    the grouped kernel, against the twin."""
    import dataclasses

    from ferry.kernels.expert_epilogue import GELU_TANH_AND_MUL, ExpertActivation

    tokens = (2 if fmt in SMALL else 3) if kernel == "pair" else 37  # the K-quants' pairs are slow to interpret
    hidden, inter = small(fmt)
    x, topk, weights, w13, w2 = make_case(fmt, 21, tokens, 3, hidden, inter, 6, dtype=dtype, skip=2)
    g = torch.Generator().manual_seed(22)
    if gelu:
        w13 = dataclasses.replace(w13, activation=GELU_TANH_AND_MUL)
    else:
        clamped = ExpertActivation(swiglu_limit=0.5, swiglu_alpha=1.702)
        w13 = dataclasses.replace(w13, bias=0.5 * torch.randn(6, 2 * inter, generator=g), activation=clamped)
        w2 = dataclasses.replace(w2, bias=0.5 * torch.randn(6, hidden, generator=g))
    got = nan_rows(x, topk)
    (expert_pair_rows_triton if kernel == "pair" else grouped_expert_rows_triton)(x, topk, weights, w13, w2, got)
    want = reference_rows(x, topk, weights, w13, w2)
    assert_rows(got, want, topk, TIGHT if dtype == torch.float32 else BF16)
    plain = reference_rows(x, topk, weights, dataclasses.replace(w13, bias=None, activation=ExpertActivation()),
                           dataclasses.replace(w2, bias=None))  # fmt: skip
    assert not torch.allclose(plain[topk >= 0], want[topk >= 0], atol=1e-2), "the epilogue changed nothing"


CASES = {}
for _fmt in FP4_SCALES:
    CASES.update(
        {
            f"{_fmt}/epilogue_pair": lambda f=_fmt: epilogue_rows_match(f, "pair", torch.float32),
            f"{_fmt}/epilogue_grouped": lambda f=_fmt: epilogue_rows_match(f, "grouped", torch.float32),
            f"{_fmt}/epilogue_pair_bfloat16": lambda f=_fmt: epilogue_rows_match(f, "pair", torch.bfloat16),
            f"{_fmt}/epilogue_grouped_bfloat16": lambda f=_fmt: epilogue_rows_match(f, "grouped", torch.bfloat16),
        }
    )
CASES.update(
    {
        f"{NVFP4}/gelu_pair": lambda: epilogue_rows_match(NVFP4, "pair", torch.float32, gelu=True),
        f"{NVFP4}/gelu_grouped_bfloat16": lambda: epilogue_rows_match(NVFP4, "grouped", torch.bfloat16, gelu=True),
    }
)
# ragged shapes: H past one step and a partial second, I one partial step (in whole fp4 groups)
RAGGED = {NVFP4: (288, 48), MXFP4: (288, 96), FP8_BLOCK: (200, 72)}
for _fmt in (NVFP4, MXFP4, FP8_BLOCK):
    CASES.update(
        {
            f"{_fmt}/pair_tiny_skipped_offset": lambda f=_fmt: pair_kernel_matches(f, 12, 2, 4, 64, 32, 6, 2, 3),
            f"{_fmt}/pair_i_not_a_multiple_of_128": lambda f=_fmt: pair_kernel_matches(f, 13, 2, 2, 256, 192, 4, 1, 0),
            f"{_fmt}/pair_ragged_two_steps": lambda f=_fmt: pair_kernel_matches(f, 15, 2, 2, *RAGGED[f], 3, 1, 1),
            f"{_fmt}/grouped_tiny_several_blocks_of_one_slot": lambda f=_fmt: grouped_kernel_matches(
                f, 2, 37, 4, 64, 32, 6, 5
            ),
            f"{_fmt}/grouped_i_not_a_multiple_of_128": lambda f=_fmt: grouped_kernel_matches(
                f, 1, 5, 2, 256, 192, 4, 2
            ),
            f"{_fmt}/grouped_ragged": lambda f=_fmt: grouped_kernel_matches(f, 4, 6, 2, *RAGGED[f], 3, 1),
            f"{_fmt}/host_aligned_rows": lambda f=_fmt: host_aligned_rows_match(f),
            f"{_fmt}/slot_window_computes_one_chunk_at_its_staging_slots": lambda f=_fmt: (
                slot_window_computes_one_chunk_at_its_staging_slots(f)
            ),
            f"{_fmt}/slot_window_with_block_starts": lambda f=_fmt: slot_window_computes_one_chunk_at_its_staging_slots(
                f, block_starts=True
            ),
            f"{_fmt}/slot_window_with_block_starts_skewed_loops": lambda f=_fmt: (
                slot_window_computes_one_chunk_at_its_staging_slots(f, block_starts=True, skewed=True)
            ),
            f"{_fmt}/tight_grid_with_max_distinct_slots": lambda f=_fmt: tight_grid_with_max_distinct_slots(f),
            f"{_fmt}/bfloat16_within_rounding": lambda f=_fmt: bfloat16_within_rounding(f),
            f"{_fmt}/mistakes_are_detected": lambda f=_fmt: mistakes_are_detected(f),
            f"{_fmt}/bf16_rows_are_the_float32_rows_rounded_once": lambda f=_fmt: (
                bf16_rows_are_the_float32_rows_rounded_once(
                    *make_case(f, 17, 40, 3, 64, 32, 9, dtype=torch.bfloat16, skip=5), num_slots=9, window=4
                )
            ),
        }
    )


def gguf_bfloat16_within_rounding(fmt):
    """`bfloat16_within_rounding` for GGUF blocks at each type's smallest shapes (whole 256-value blocks for the
    K-quants and IQ4_XS; fewer pairs, as the interpreter is slow at them): both kernels within rounding of the
    twin, where weights not exact in bf16 (the 256-value types') and the interpreter's truncations of the
    activations drift to a few units of the largest row (some 0.1 at rows near 7), and the pair kernel computing
    the pairs in two groups gives the bits it gives at once."""
    x, topk, weights, w13, w2 = make_case(fmt, 3, 2, 2, *small(fmt), 3, dtype=torch.bfloat16)
    want = reference_rows(x, topk, weights, w13, w2).sum(dim=1).to(torch.bfloat16).float()
    tol = dict(rtol=2e-2, atol=0.03 * want.abs().max().item())
    at_once = nan_rows(x, topk)
    for kernel, got in ((grouped_expert_rows_triton, nan_rows(x, topk)), (expert_pair_rows_triton, at_once)):
        kernel(x, topk, weights, w13, w2, got)
        torch.testing.assert_close(got.sum(dim=1).to(torch.bfloat16).float(), want, **tol)
    first = torch.tensor([[True, False], [True, True]])  # a token's pairs split between the groups, one's not
    in_groups = nan_rows(x, topk)
    expert_pair_rows_triton(x, torch.where(first, topk, -1), weights, w13, w2, in_groups)
    expert_pair_rows_triton(x, torch.where(first, -1, topk), weights, w13, w2, in_groups)
    assert torch.equal(at_once, in_groups)


def gguf_mixed_layer_matches(kernel, dtype):
    """A Q4_K_M layer of a `gguf-mixed` file: w13 in Q4_K, w2 in Q6_K, each `q` the prefix of slot rows sized for
    a larger type (the slots hold every layer's), through the pair or the grouped kernel, against the twin."""
    import dataclasses

    hidden, inter, slots = 256, 256, 5
    x, topk, weights, w13, _ = make_case(gguf_fmt("Q4_K"), 23, 3 if kernel == "pair" else 21, 2, hidden, inter, slots)
    x = x.to(dtype)
    _, w2 = make_experts(gguf_fmt("Q6_K"), hidden, inter, slots, torch.Generator().manual_seed(24))
    used = w13.q[0].numel()
    wide = torch.full((slots, used * 210 // 144), 255, dtype=torch.uint8)  # slot rows sized for Q6_K; NaN d past q
    wide[:, :used] = w13.q.reshape(slots, used)
    w13 = dataclasses.replace(w13, q=wide[:, :used].view(w13.q.shape))
    got = nan_rows(x, topk)
    (expert_pair_rows_triton if kernel == "pair" else grouped_expert_rows_triton)(x, topk, weights, w13, w2, got)
    assert_rows(got, reference_rows(x, topk, weights, w13, w2), topk, TIGHT if dtype == torch.float32 else BF16)


CASES.update(
    {
        "gguf-mixed/q4_k_q6_k_pair": lambda: gguf_mixed_layer_matches("pair", torch.float32),
        "gguf-mixed/q4_k_q6_k_grouped": lambda: gguf_mixed_layer_matches("grouped", torch.float32),
    }
)


@triton.jit
def _decoded_weights_kernel(q_ptr, out_ptr, cols, stride_q, read_cols, GGML: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr):  # fmt: skip
    """out[:, c] = `gguf_weights` of the rows at q_ptr, input c masked from read_cols on (a program BLOCK inputs)."""
    r = tl.arange(0, ROWS)[:, None]
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[None, :]
    w = gguf_weights(q_ptr + r * stride_q, c, (c < read_cols) & (r < ROWS), GGML)
    tl.store(out_ptr + r * cols + c, w)


@triton.jit
def _decoded_tile_kernel(q_ptr, out_ptr, cols, stride_q, read_cols, GGML: tl.constexpr, ROWS: tl.constexpr):
    """out[:, c] = `gguf_tile` of the rows at q_ptr, input c masked from read_cols on (a program 256 inputs)."""
    r = tl.arange(0, ROWS)[:, None, None]
    s = tl.arange(0, 8)[None, :, None]
    i = tl.arange(0, 32)[None, None, :]
    k0 = tl.program_id(0) * 256
    w = gguf_tile(q_ptr + r * stride_q, k0, s, i, r < ROWS, read_cols, GGML)
    c = k0 + 32 * s + i
    tl.store(out_ptr + r * cols + c, w, mask=c < cols)


def decode_is_the_gguf_packages(ggml_type):
    """The kernels' in-register decode, weight by weight (`gguf_weights`) and 256 inputs a tile (`gguf_tile`), of
    random blocks equals the gguf package's numpy dequantization bit for bit, every code and scale of the type
    drawn (finite fp16 scales; MXFP4's e8m0 bytes 0 to 252, its two subnormal scales included), and masked weights
    read 0."""
    import gguf
    import numpy as np

    block, size = gguf_blocks.BLOCKS[ggml_type]
    rows, cols = 8, 4 * block
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset, unit in GGUF_TEST_TYPES[ggml_type]:
        scales = (np.sign(unit) * rng.uniform(1e-3, 1e-2, blocks.shape[0])).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if ggml_type == "MXFP4":
        blocks[:, 0] = np.arange(blocks.shape[0]) % 253
    q = torch.from_numpy(blocks.reshape(rows, -1).copy())
    want = torch.from_numpy(gguf.quants.dequantize(q.numpy(), gguf.GGMLQuantizationType[ggml_type]).astype(np.float32))
    got = torch.full((rows, cols), float("nan"))
    read_cols = cols - block // 2  # the last block's second half masked
    _decoded_weights_kernel[(cols // 64,)](q, got, cols, q.stride(0), read_cols, GGML=GGUF_KERNEL_TYPES[ggml_type],
                                           ROWS=rows, BLOCK=64)  # fmt: skip
    tiled = torch.full((rows, cols), float("nan"))
    _decoded_tile_kernel[(triton.cdiv(cols, 256),)](q, tiled, cols, q.stride(0), read_cols,
                                                    GGML=GGUF_KERNEL_TYPES[ggml_type], ROWS=rows)  # fmt: skip
    for name, decoded in (("weight by weight", got), ("by tiles", tiled)):
        assert torch.equal(decoded[:, :read_cols], want[:, :read_cols]), f"the decode {name} differs from the package's"
        assert torch.equal(decoded[:, read_cols:], torch.zeros(rows, cols - read_cols)), f"masked ({name}) must read 0"


# GGUF blocks: 32-value blocks at small shapes; 256-value blocks (K-quants, IQ4_XS) whole, H two of them (the pair
# kernels' and the grouped kernels' steps of 64 inputs cross block boundaries), I one
GGUF_RAGGED = {f: (512, 256) if f in SMALL else (288, 96) for f in GGUF}
for _fmt in GGUF:
    CASES.update(
        {
            f"{_fmt}/decode_is_the_gguf_packages": lambda f=_fmt: decode_is_the_gguf_packages(f[5:].upper()),
            f"{_fmt}/pair_tiny_skipped_offset": lambda f=_fmt: (
                pair_kernel_matches(f, 12, 2, 4, *small(f), 6, 2, 3)
                if f not in SMALL
                else pair_kernel_matches(f, 12, 2, 2, *small(f), 4, 1, 3)  # 3 pairs: the K-quants' are slow
            ),
            f"{_fmt}/pair_ragged_two_steps": lambda f=_fmt: pair_kernel_matches(f, 15, 2, 2, *GGUF_RAGGED[f], 3, 1, 1),
            f"{_fmt}/grouped_tiny_several_blocks_of_one_slot": lambda f=_fmt: grouped_kernel_matches(
                f, 2, 37, 4, *small(f), 6, 5
            ),
            f"{_fmt}/grouped_ragged": lambda f=_fmt: grouped_kernel_matches(f, 4, 6, 2, *GGUF_RAGGED[f], 3, 1),
            f"{_fmt}/slot_window_with_block_starts": lambda f=_fmt: slot_window_computes_one_chunk_at_its_staging_slots(
                f, block_starts=True
            ),
            f"{_fmt}/bfloat16_within_rounding": lambda f=_fmt: gguf_bfloat16_within_rounding(f),
            f"{_fmt}/mistakes_are_detected": lambda f=_fmt: mistakes_are_detected(f),
            f"{_fmt}/bf16_rows_are_the_float32_rows_rounded_once": lambda f=_fmt: (
                bf16_rows_are_the_float32_rows_rounded_once(
                    *make_case(f, 17, 12 if f in SMALL else 40, 3, *small(f), 5, dtype=torch.bfloat16, skip=3),
                    num_slots=5,
                    window=2,
                )
            ),
            f"{_fmt}/epilogue_pair": lambda f=_fmt: epilogue_rows_match(f, "pair", torch.float32),
            f"{_fmt}/epilogue_grouped_bfloat16": lambda f=_fmt: epilogue_rows_match(f, "grouped", torch.bfloat16),
        }
    )
CASES.update(
    {
        f"{NVFP4}/gelu_pair": lambda: epilogue_rows_match(NVFP4, "pair", torch.float32, gelu=True),
        f"{NVFP4}/gelu_grouped_bfloat16": lambda: epilogue_rows_match(NVFP4, "grouped", torch.bfloat16, gelu=True),
    }
)


def main() -> None:
    """The cases named by the prefixes given (test_gguf_expert_kernels.py runs the GGUF ones a child a type:
    interpreted, they are slow), else every case of the other formats."""
    prefixes = tuple(sys.argv[1:])
    results = {}
    for name, case in CASES.items():
        if not (name.startswith(prefixes) if prefixes else not name.startswith("gguf-")):
            continue
        try:
            case()
            results[name] = None
        except Exception:  # noqa: BLE001 - every failure is reported to the parent test
            results[name] = traceback.format_exc()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
