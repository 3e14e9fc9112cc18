"""Routed experts pair by pair (decode) straight from quantized slots, in Triton: the NVFP4/MXFP4 and
FP8-block twins of expert_pair_gemv.py (same contract, grid and fusions; GGUF blocks go on to
gguf_expert_gemv.py); reference:
`quantized_expert_rows_reference` (kernels/grouped_expert_gemm_reference.py).

Why in registers: decode is paced by the bytes the GEMV reads, and a quantized slot holds 0.28
(NVFP4) or 0.5 (FP8) of a bf16 slot's bytes; a dense copy would write and read the bf16 bytes on
top. The codes are decoded to float32 and meet x in float32; each scale group's (NVFP4: 16 inputs,
MXFP4: 32, FP8: a 128-input block) sum of code x input is then multiplied by its scale once, and NVFP4's row
scale once per output. That is the twin's sum of dequantized weights times inputs, reassociated: the
same value up to float32 rounding, without rounding each weight to x's dtype as `dequantize_slot`
does (a bf16 x differs from the twin by that rounding; the tests allow it). Dequantizing each weight
took three multiplies and two conversions per code, and made the kernels ALU-bound at 6x the HBM
bound. The projections, silu and the product are rounded as
the plain kernel rounds them.

Tiles keep each scale on its own axis, so a scale is loaded once and broadcast, never gathered:
* NVFP4 [BLOCK_N, groups, 8 bytes]: byte b of group g holds inputs 16g + 2b (low nibble) and
  16g + 2b + 1 (high); the two nibbles are decoded apart and meet x's even and odd inputs (no
  interleaving); the group's float8 scale broadcasts along the bytes, the row's gscale along both.
  MXFP4 is the same kernel (`_fp4_*`) with [BLOCK_N, groups, 16 bytes], an e8m0 scale and no gscale.
* FP8-block [BLOCK_N, column blocks, 128]: one float32 scale per (row block, column block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.expert_epilogue import SILU_AND_MUL, activation_code, gate_up_activation
from ferry.kernels.gguf_block_decode import GGUF_KERNEL_TYPES
from ferry.kernels.gguf_blocks import BLOCKS
from ferry.kernels.gguf_expert_gemv import launch_gguf_pair_kernels
from ferry.kernels.pair_tiles import TILES
from ferry.kernels.quantized_experts import FP4_SCALES, FP8_BLOCK, QuantizedFamily
from ferry.kernels.router_topk import mark_args, mark_routed_slot


@triton.jit
def _e2m1_low(b):
    """The e2m1 codes in the low nibbles of uint8 `b`, times 2**-14, as float32: sign and the three
    value bits placed as a float16's sign, low exponent bits and top mantissa bit read exactly
    2**-14 times the code's value (code 1, 0.5, as the float16 subnormal 2**-15). No table, no branch."""
    h = ((b & 0x08).to(tl.uint16) << 12) | ((b & 0x07).to(tl.uint16) << 9)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_high(b):
    """`_e2m1_low` for the high nibbles."""
    h = ((b & 0x80).to(tl.uint16) << 8) | ((b & 0x70).to(tl.uint16) << 5)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp4_scales(s_ptrs, mask, E8M0: tl.constexpr):
    """The group scales at s_ptrs as float32, times 2**14 (exact; see _e2m1_low): float8_e4m3fn values
    (nvfp4), or e8m0 bytes (mxfp4), each a float32's exponent field worth 2^(s - 127) (byte 0: the
    subnormal 2^-127). Masked scales read 0 (e8m0: 2^-127), against codes read 0."""
    if E8M0:
        s = tl.load(s_ptrs, mask=mask, other=0)
        bits = tl.where(s == 0, 0x00400000, s.to(tl.int32) << 23)
        return bits.to(tl.float32, bitcast=True) * 16384.0
    else:
        return tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32) * 16384.0


@triton.jit
def _fp4_group_dots(b, scale, x_lo, x_hi):
    """[N, G]: for byte tile b [N, G, GROUP / 2], each group's sum of code x input (codes as `_e2m1_low`
    reads them: the low nibbles meet x's even inputs x_lo [G, GROUP / 2], the high ones the odd x_hi),
    times the group's scale [N, G] (`_fp4_scales`). nvfp4's row gscale is applied once, at the end."""
    dots = tl.sum(_e2m1_low(b) * x_lo[None, :, :] + _e2m1_high(b) * x_hi[None, :, :], axis=2)
    return dots * scale


@triton.jit
def _fp4_inputs(x_ptrs, g_ok):
    """A step's inputs at x_ptrs [G, GROUP / 2] (the even ones) and each one's odd neighbour, as float32."""
    x_lo = tl.load(x_ptrs, mask=g_ok[:, None], other=0.0).to(tl.float32)
    x_hi = tl.load(x_ptrs + 1, mask=g_ok[:, None], other=0.0).to(tl.float32)
    return x_lo, x_hi


@triton.jit
def _fp4_step_dots(q_ptrs, s_ptrs, x_lo, x_hi, m2, E8M0: tl.constexpr):
    """One loop step of an fp4 GEMV: [N, G] group dots of byte tile q_ptrs [N, G, GROUP / 2] under scales
    s_ptrs [N, G] (mask m2 [N, G]) with the inputs `_fp4_inputs` read."""
    scale = _fp4_scales(s_ptrs, m2, E8M0)
    return _fp4_group_dots(tl.load(q_ptrs, mask=m2[:, :, None], other=0), scale, x_lo, x_hi)


@triton.jit
def _fp8_block_dots(q, scale, x):
    """[N, C]: for float8 tile q [N, C, 128], each column block's sum of code x input (x [C, 128]),
    times the block's scale [N, C]."""
    return tl.sum(q.to(tl.float32) * x[None, :, :], axis=2) * scale


@triton.jit
def _silu_and_mul(acc_g, acc_u, out_ty: tl.constexpr):
    """The plain kernel's epilogue: projections, silu and the product each rounded to out_ty."""
    gate = acc_g.to(out_ty).to(tl.float32)
    up = acc_u.to(out_ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    return (silu * up).to(out_ty)


# slot_offset follows the layer (the all-resident store passes the layer's first slot): not specialised on
@triton.jit(do_not_specialize=["slot_offset"])
def _fp4_pair_gate_up_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    g_ptr,
    act_ptr,
    slots_ptr,
    slot_offset,
    top_k,
    H,
    I,
    table_ptr,
    n_rows_ptr,
    stride_xt,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    stride_gs,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    MARK: tl.constexpr,
    HAS_N_ROWS: tl.constexpr,
    b_ptr,
    stride_bs,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    """nvfp4 (GROUP 16, float8 scales, ROW_SCALE) and mxfp4 (GROUP 32, E8M0 scales) gate/up rows of a pair, with
    the epilogue of kernels/expert_epilogue.py (the slot's biases where HAS_BIAS, the clamped SwiGLU where SWIGLU)."""
    pair = tl.program_id(0)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    if slot < 0:  # skipped pair (another group computes it): leave its row alone
        return
    slot += slot_offset
    token = pair // top_k
    if MARK:  # the resident store's routed table, once a pair (expert_pair_gemv.py's `mark`)
        if tl.program_id(1) == 0:
            mark_routed_slot(table_ptr, n_rows_ptr, slot, token, HAS_N_ROWS)
    BYTES: tl.constexpr = GROUP // 2  # a group's bytes
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    rows = offs_n.to(tl.int64)
    offs_g = tl.arange(0, GROUPS)
    offs_b = tl.arange(0, BYTES)
    q_g = (
        q_ptr
        + slot * stride_qs
        + rows[:, None, None] * stride_qo
        + offs_g[None, :, None] * BYTES
        + offs_b[None, None, :]
    )
    q_u = q_g + I * stride_qo  # up rows follow the gate rows
    s_g = s_ptr + slot * stride_ss + rows[:, None] * stride_so + offs_g[None, :]
    s_u = s_g + I * stride_so
    x_lo = x_ptr + token * stride_xt + offs_g[:, None] * GROUP + offs_b[None, :] * 2  # [GROUPS, BYTES]: even inputs
    w_ty = act_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    groups = H // GROUP
    for g0 in range(0, groups, GROUPS):
        g_ok = offs_g + g0 < groups
        a_lo, a_hi = _fp4_inputs(x_lo + g0 * GROUP, g_ok)
        m2 = n_ok[:, None] & g_ok[None, :]
        acc_g += _fp4_step_dots(q_g + g0 * BYTES, s_g + g0, a_lo, a_hi, m2, E8M0)
        acc_u += _fp4_step_dots(q_u + g0 * BYTES, s_u + g0, a_lo, a_hi, m2, E8M0)
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if ROW_SCALE:
        g_row = g_ptr + slot * stride_gs + offs_n
        gate = gate * tl.load(g_row, mask=n_ok, other=0.0)
        up = up * tl.load(g_row + I, mask=n_ok, other=0.0)
    bias_gate = 0.0
    bias_up = 0.0
    if HAS_BIAS:  # float32 in the row, rounded to the model dtype as the reference adds it
        b_ptrs = b_ptr + slot * stride_bs + offs_n
        bias_gate = tl.load(b_ptrs, mask=n_ok, other=0.0).to(w_ty).to(tl.float32)
        bias_up = tl.load(b_ptrs + I, mask=n_ok, other=0.0).to(w_ty).to(tl.float32)
    act = gate_up_activation(gate, up, bias_gate, bias_up, alpha, limit, w_ty, HAS_BIAS, SWIGLU)
    tl.store(act_ptr + pair.to(tl.int64) * I + offs_n, act, mask=n_ok)


@triton.jit(do_not_specialize=["slot_offset"])
def _fp4_pair_down_kernel(
    act_ptr,
    q_ptr,
    s_ptr,
    g_ptr,
    rows_ptr,
    weights_ptr,
    slots_ptr,
    slot_offset,
    H,
    I,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    stride_gs,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    b_ptr,
    stride_bs,
    HAS_BIAS: tl.constexpr,
):
    """nvfp4 and mxfp4 down rows of a pair (as _fp4_pair_gate_up_kernel)."""
    pair = tl.program_id(0)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    if slot < 0:
        return
    slot += slot_offset
    BYTES: tl.constexpr = GROUP // 2
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (H)
    n_ok = offs_n < H
    rows = offs_n.to(tl.int64)
    offs_g = tl.arange(0, GROUPS)  # reduction over I, GROUP inputs a group
    offs_b = tl.arange(0, BYTES)
    q_w = (
        q_ptr
        + slot * stride_qs
        + rows[:, None, None] * stride_qo
        + offs_g[None, :, None] * BYTES
        + offs_b[None, None, :]
    )
    s_w = s_ptr + slot * stride_ss + rows[:, None] * stride_so + offs_g[None, :]
    a_lo = act_ptr + pair.to(tl.int64) * I + offs_g[:, None] * GROUP + offs_b[None, :] * 2
    w_ty = act_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    groups = I // GROUP
    for g0 in range(0, groups, GROUPS):
        g_ok = offs_g + g0 < groups
        x_lo, x_hi = _fp4_inputs(a_lo + g0 * GROUP, g_ok)
        acc += _fp4_step_dots(q_w + g0 * BYTES, s_w + g0, x_lo, x_hi, n_ok[:, None] & g_ok[None, :], E8M0)
    y = tl.sum(acc, axis=1)
    if ROW_SCALE:
        y = y * tl.load(g_ptr + slot * stride_gs + offs_n, mask=n_ok, other=0.0)
    y = y.to(w_ty).to(tl.float32)
    if HAS_BIAS:  # added and rounded as the reference adds it
        bias = tl.load(b_ptr + slot * stride_bs + offs_n, mask=n_ok, other=0.0).to(w_ty).to(tl.float32)
        y = (y + bias).to(w_ty).to(tl.float32)
    routing = tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(rows_ptr + pair.to(tl.int64) * H + offs_n, y * routing, mask=n_ok)


@triton.jit(do_not_specialize=["slot_offset"])
def _fp8_pair_gate_up_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    act_ptr,
    slots_ptr,
    slot_offset,
    top_k,
    H,
    I,
    up_row_block,
    table_ptr,
    n_rows_ptr,
    stride_xt,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    MARK: tl.constexpr,
    HAS_N_ROWS: tl.constexpr,
):
    pair = tl.program_id(0)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    if slot < 0:
        return
    slot += slot_offset
    token = pair // top_k
    if MARK:  # the resident store's routed table, once a pair (expert_pair_gemv.py's `mark`)
        if tl.program_id(1) == 0:
            mark_routed_slot(table_ptr, n_rows_ptr, slot, token, HAS_N_ROWS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    rows = offs_n.to(tl.int64)
    offs_c = tl.arange(0, BLOCKS)
    offs_i = tl.arange(0, 128)
    cols = offs_c[:, None] * 128 + offs_i[None, :]  # [BLOCKS, 128]
    q_g = q_ptr + slot * stride_qs + rows[:, None, None] * stride_qo + cols[None, :, :]
    q_u = q_g + I * stride_qo
    # gate row o is in scale row o // 128; up's blocks restart at row I, after gate's ceil(I / 128)
    s_g = s_ptr + slot * stride_ss + (offs_n // 128)[:, None] * stride_so + offs_c[None, :]
    s_u = s_g + up_row_block * stride_so
    x_row = x_ptr + token * stride_xt + cols
    w_ty = act_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_N, BLOCKS), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCKS), dtype=tl.float32)
    for c0 in range(0, tl.cdiv(H, 128), BLOCKS):
        k_ok = cols + c0 * 128 < H  # the last column block may be partial
        a = tl.load(x_row + c0 * 128, mask=k_ok, other=0.0).to(tl.float32)
        m2 = n_ok[:, None] & (offs_c[None, :] + c0 < tl.cdiv(H, 128))
        m3 = n_ok[:, None, None] & k_ok[None, :, :]
        sg = tl.load(s_g + c0, mask=m2, other=0.0)
        su = tl.load(s_u + c0, mask=m2, other=0.0)
        acc_g += _fp8_block_dots(tl.load(q_g + c0 * 128, mask=m3, other=0.0), sg, a)
        acc_u += _fp8_block_dots(tl.load(q_u + c0 * 128, mask=m3, other=0.0), su, a)
    act = _silu_and_mul(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), w_ty)
    tl.store(act_ptr + pair.to(tl.int64) * I + offs_n, act, mask=n_ok)


@triton.jit(do_not_specialize=["slot_offset"])
def _fp8_pair_down_kernel(
    act_ptr,
    q_ptr,
    s_ptr,
    rows_ptr,
    weights_ptr,
    slots_ptr,
    slot_offset,
    H,
    I,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    pair = tl.program_id(0)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    if slot < 0:
        return
    slot += slot_offset
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (H)
    n_ok = offs_n < H
    rows = offs_n.to(tl.int64)
    offs_c = tl.arange(0, BLOCKS)
    offs_i = tl.arange(0, 128)
    cols = offs_c[:, None] * 128 + offs_i[None, :]  # reduction over I
    q_w = q_ptr + slot * stride_qs + rows[:, None, None] * stride_qo + cols[None, :, :]
    s_w = s_ptr + slot * stride_ss + (offs_n // 128)[:, None] * stride_so + offs_c[None, :]  # w2 is one part
    a_row = act_ptr + pair.to(tl.int64) * I + cols
    w_ty = act_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCKS), dtype=tl.float32)
    for c0 in range(0, tl.cdiv(I, 128), BLOCKS):
        k_ok = cols + c0 * 128 < I
        a = tl.load(a_row + c0 * 128, mask=k_ok, other=0.0).to(tl.float32)
        s = tl.load(s_w + c0, mask=n_ok[:, None] & (offs_c[None, :] + c0 < tl.cdiv(I, 128)), other=0.0)
        acc += _fp8_block_dots(tl.load(q_w + c0 * 128, mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0), s, a)
    y = tl.sum(acc, axis=1).to(w_ty).to(tl.float32)
    routing = tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(rows_ptr + pair.to(tl.int64) * H + offs_n, y * routing, mask=n_ok)


def check_quantized_families(h: int, w13: QuantizedFamily, w2: QuantizedFamily) -> int:
    """I (the intermediate size) once the two families fit H and each other, and their views are what
    the kernels assume (one format, or GGUF blocks of types with kernels each, as a `gguf-mixed` layer's w13 and w2
    may differ; fp4 inputs in whole groups, GGUF rows in whole blocks; last axes unit-stride)."""
    formats = (*FP4_SCALES, FP8_BLOCK)
    refused = ValueError(f"w13 and w2 must be QuantizedFamily of one format ({', '.join(formats)}) or GGUF blocks")
    if not isinstance(w2, QuantizedFamily) or (w13.ggml_type is None) != (w2.ggml_type is None):
        raise refused
    if w13.ggml_type is None and (w13.fmt != w2.fmt or w13.fmt not in formats):
        raise refused
    for ggml_type in {w13.ggml_type, w2.ggml_type} - {None}:
        if ggml_type not in GGUF_KERNEL_TYPES:
            raise ValueError(
                f"no Triton kernel reads GGUF {ggml_type} blocks (those of {', '.join(GGUF_KERNEL_TYPES)} have them)"
            )
    inter = w2.cols
    if (w13.rows, w13.cols, w13.part_rows, w2.rows, w2.part_rows) != (2 * inter, h, inter, h, h):
        raise ValueError(
            f"quantized families do not fit H={h}: w13 {w13.rows}x{w13.cols} (parts of "
            f"{w13.part_rows}), w2 {w2.rows}x{w2.cols} (parts of {w2.part_rows})"
        )
    if w13.ggml_type is not None:  # rows of whole blocks: H of w13's, I of w2's
        if h % BLOCKS[w13.ggml_type][0] or inter % BLOCKS[w2.ggml_type][0]:
            raise ValueError(
                f"GGUF {w13.ggml_type} gate/up rows and {w2.ggml_type} down rows need H ({h}) and I ({inter}) in "
                "whole blocks"
            )
    group = FP4_SCALES[w13.fmt].group if w13.fmt in FP4_SCALES else 1
    if h % group or inter % group:
        raise ValueError(f"{w13.fmt} needs H ({h}) and I ({inter}) to be multiples of {group}")
    views = [v for f in (w13, w2) for v in (f.q, f.scale, f.gscale) if v is not None]
    if any(v.stride(-1) != 1 for v in views):
        raise ValueError("the last axis of every quantized view must be contiguous")
    return inter


def quantized_epilogue_args(w13: QuantizedFamily, w2: QuantizedFamily) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(w13's biases, w2's, the fp4 kernels' epilogue arguments) of quantized families (kernels/expert_epilogue.py):
    float32 views of the rows' bias parts where the experts have them (else stand-ins, never read); the fp8-block
    kernels compute neither biases nor the clamped SwiGLU, so such families of that format are refused."""
    has_bias, activation = w13.bias is not None, w13.activation
    if (w2.bias is not None) != has_bias:
        raise ValueError("an expert's gate/up and down projections have biases both or neither")
    if (has_bias or activation != SILU_AND_MUL) and w13.fmt not in FP4_SCALES and w13.ggml_type is None:
        raise ValueError(f"the {w13.fmt} expert kernels compute no expert biases or activation but silu")
    if has_bias and (w13.bias.stride(-1) != 1 or w2.bias.stride(-1) != 1):
        raise ValueError("expert biases must be unit-stride along their rows")
    args = dict(
        stride_b13=w13.bias.stride(0) if has_bias else 0,
        stride_b2=w2.bias.stride(0) if has_bias else 0,
        alpha=float(activation.swiglu_alpha),
        limit=float(activation.swiglu_limit),
        HAS_BIAS=has_bias,
        SWIGLU=activation_code(activation),
    )
    stand_in13, stand_in2 = (w13.q, w2.q) if w13.scale is None else (w13.scale, w2.scale)
    return (w13.bias if has_bias else stand_in13), (w2.bias if has_bias else stand_in2), args


def quantized_pair_rows_triton(
    x,
    topk_slots,
    topk_weights,
    w13: QuantizedFamily,
    w2: QuantizedFamily,
    rows,
    slot_offset: int = 0,
    mark: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> None:
    """`expert_pair_rows_triton` for quantized slots (same contract, `slot_offset` and `mark` included)."""
    table, n_rows = mark_args(mark, rows)
    marking = dict(MARK=mark is not None, HAS_N_ROWS=mark is not None and mark[1] is not None)
    t, h = x.shape
    top_k = topk_slots.shape[1]
    inter = check_quantized_families(h, w13, w2)
    if x.stride(1) != 1:
        raise ValueError("x rows must be contiguous")
    if rows.dtype != torch.float32 or tuple(rows.shape) != (t, top_k, h) or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous float32 [{t}, {top_k}, {h}] tensor")
    num_pairs = t * top_k
    if num_pairs == 0:
        return
    slots = topk_slots if topk_slots.is_contiguous() else topk_slots.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    if w13.ggml_type is not None:  # GGUF blocks: gguf_expert_gemv.py
        b13, b2, epilogue = quantized_epilogue_args(w13, w2)
        launch_gguf_pair_kernels(
            x, w13, w2, act, rows, weights, slots, slot_offset, top_k, table, n_rows, marking, b13, b2, epilogue
        )
        return
    tiles = TILES[w13.fmt]
    up_grid, down_grid = (
        (num_pairs, triton.cdiv(inter, tiles.gate_up_rows)),
        (num_pairs, triton.cdiv(h, tiles.down_rows)),
    )
    up_tile = dict(BLOCK_N=tiles.gate_up_rows, num_warps=tiles.gate_up_warps)
    down_tile = dict(BLOCK_N=tiles.down_rows, num_warps=tiles.down_warps)
    b13, b2, epilogue = quantized_epilogue_args(w13, w2)
    if w13.fmt in FP4_SCALES:
        fp4 = FP4_SCALES[w13.fmt]
        scaling = dict(GROUP=fp4.group, E8M0=fp4.e8m0, ROW_SCALE=fp4.row_scale)
        # no row scale (mxfp4): the kernels never read g_ptr; any tensor stands in
        g13, g2 = (w13.gscale, w2.gscale) if fp4.row_scale else (w13.scale, w2.scale)
        _fp4_pair_gate_up_kernel[up_grid](
            x,
            w13.q,
            w13.scale,
            g13,
            act,
            slots,
            slot_offset,
            top_k,
            h,
            inter,
            table,
            n_rows,
            x.stride(0),
            w13.q.stride(0),
            w13.q.stride(1),
            w13.scale.stride(0),
            w13.scale.stride(1),
            g13.stride(0),
            GROUPS=tiles.gate_up_k,
            **scaling,
            **up_tile,
            **marking,
            b_ptr=b13,
            stride_bs=epilogue["stride_b13"],
            alpha=epilogue["alpha"],
            limit=epilogue["limit"],
            HAS_BIAS=epilogue["HAS_BIAS"],
            SWIGLU=epilogue["SWIGLU"],
        )
        _fp4_pair_down_kernel[down_grid](
            act,
            w2.q,
            w2.scale,
            g2,
            rows,
            weights,
            slots,
            slot_offset,
            h,
            inter,
            w2.q.stride(0),
            w2.q.stride(1),
            w2.scale.stride(0),
            w2.scale.stride(1),
            g2.stride(0),
            GROUPS=tiles.down_k,
            **scaling,
            **down_tile,
            b_ptr=b2,
            stride_bs=epilogue["stride_b2"],
            HAS_BIAS=epilogue["HAS_BIAS"],
        )
    else:
        _fp8_pair_gate_up_kernel[up_grid](
            x,
            w13.q,
            w13.scale,
            act,
            slots,
            slot_offset,
            top_k,
            h,
            inter,
            w13.row_blocks_per_part,
            table,
            n_rows,
            x.stride(0),
            w13.q.stride(0),
            w13.q.stride(1),
            w13.scale.stride(0),
            w13.scale.stride(1),
            BLOCKS=tiles.gate_up_k,
            **up_tile,
            **marking,
        )
        _fp8_pair_down_kernel[down_grid](
            act,
            w2.q,
            w2.scale,
            rows,
            weights,
            slots,
            slot_offset,
            h,
            inter,
            w2.q.stride(0),
            w2.q.stride(1),
            w2.scale.stride(0),
            w2.scale.stride(1),
            BLOCKS=tiles.down_k,
            **down_tile,
        )
