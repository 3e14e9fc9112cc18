"""Grouped expert GEMM by slot straight from quantized slots, in Triton: the NVFP4/MXFP4 and FP8-block
twins of grouped_expert_gemm.py (same alignment, grid, slot window, fusions and rounding; GGUF blocks go on to
gguf_expert_gemm.py);
reference: `quantized_expert_rows_reference` (kernels/grouped_expert_gemm_reference.py).

Each program dequantizes its slot's weight tile in registers (as `dequantize_slot` does, rounded to
x's dtype: quantized_expert_gemv.py says why that gives the same values) and feeds it to tl.dot
with BLOCK_M of the slot's tokens, so every weight byte is read once per block of tokens and no
dense copy of the weights exists. Every load is a whole tile (vectorised, and pipelined by Triton):
* NVFP4: a step of BLOCK_K inputs is BLOCK_K / 2 bytes; the low nibbles [BLOCK_K / 2, BLOCK_N] meet
  x's even inputs and the high nibbles its odd ones, in two dots (the same sum, without
  interleaving the nibbles); x's tile is split into its even and odd columns in registers, and the
  step's BLOCK_K / 16 group scales are loaded once and spread over their groups' bytes there
  (a gather per byte costs one load instruction per weight byte).
* MXFP4: the same kernels (`_fp4_*`, the group size and scale kind constexpr): BLOCK_K / 32 e8m0
  scales a step, each spread over 16 bytes, and no row scale.
* FP8-block: a step stays in one 128-column block, so its scales are one per output row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.aligned_blocks import SLOT_WINDOW_ALL, block_rows, grouped_launch, window_blocks
from ferry.kernels.expert_epilogue import gate_up_activation
from ferry.kernels.expert_rows_sum import check_rows
from ferry.kernels.gguf_expert_gemm import launch_gguf_grouped_kernels
from ferry.kernels.quantized_expert_gemv import (
    _e2m1_high,
    _e2m1_low,
    _fp4_scales,
    check_quantized_families,
    quantized_epilogue_args,
)
from ferry.kernels.quantized_experts import FP4_SCALES, FP8_BLOCK, QuantizedFamily

BLOCK_N = 64


def block_k_for(fmt: str, block_m: int, dtype: torch.dtype) -> int:
    """Inputs a reduction step (a divisor of 128, so an FP8 step stays in one column block). Measured
    on Qwen3-30B-A3B's experts: 64, but 128 for FP8 with bf16 x at decode's BLOCK_M
    (179 us against 260 at 64 tokens); float32 tiles are twice the bytes (and compile slowly), 64."""
    return 128 if fmt == FP8_BLOCK and block_m <= 16 and dtype != torch.float32 else 64


@triton.jit
def _fp4_tiles(b, scale, gscale, BYTES: tl.constexpr, ROW_SCALE: tl.constexpr, W_TY: tl.constexpr):
    """Byte tile b [J, N] as its low-nibble and high-nibble weights in W_TY: code * group scale (its
    [J / BYTES, N] group scales, times 2**14 (see _e2m1_low), each spread over its group's BYTES bytes),
    then (nvfp4, ROW_SCALE) * gscale [1, N]: dequantize_slot's products in its order."""
    groups: tl.constexpr = scale.shape[0]
    cols: tl.constexpr = scale.shape[1]
    s = tl.reshape(tl.broadcast_to(scale[:, None, :], (groups, BYTES, cols)), (groups * BYTES, cols))
    if ROW_SCALE:
        lo = ((_e2m1_low(b) * s) * gscale).to(W_TY)
        hi = ((_e2m1_high(b) * s) * gscale).to(W_TY)
    else:
        lo = (_e2m1_low(b) * s).to(W_TY)
        hi = (_e2m1_high(b) * s).to(W_TY)
    return lo, hi


@triton.jit
def _fp4_weight_step(
    q_ptrs,
    s_ptrs,
    gscale,
    k0,
    K,
    n_ok,
    offs_j,
    offs_s,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    W_TY: tl.constexpr,
):
    """A reduction step's weights from k0 (of K inputs, K % GROUP == 0: a group is in or out whole), as
    `_fp4_tiles`: bytes q_ptrs [BLOCK_K / 2, BLOCK_N] (offs_j the step's bytes), scales s_ptrs
    [BLOCK_K / GROUP, BLOCK_N] (offs_s its groups), columns n_ok."""
    w_mask = (offs_j + k0 // 2 < K // 2)[:, None] & n_ok[None, :]
    s_mask = (offs_s + k0 // GROUP < K // GROUP)[:, None] & n_ok[None, :]
    scale = _fp4_scales(s_ptrs + k0 // GROUP, s_mask, E8M0)
    return _fp4_tiles(tl.load(q_ptrs + k0 // 2, mask=w_mask, other=0), scale, gscale, GROUP // 2, ROW_SCALE, W_TY)


@triton.jit
def _even_odd(x_ptrs, mask, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile loaded whole (vector loads), split into its even and odd columns."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    return tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))


@triton.jit
def _fp4_gate_up_block(
    x_ptr,
    q_ptr,
    s_ptr,
    g_ptr,
    act_ptr,
    sorted_pairs_ptr,
    pid_m,
    pid_n,
    slot,
    num_pairs,
    top_k,
    H,
    I,
    stride_xt,
    stride_xh,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    stride_gs,
    stride_am,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    b_ptr,
    stride_bs,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    """_fp4_gate_up_kernel's work: block pid_m at slot `slot` (shifted), column tile pid_n; the epilogue
    (kernels/expert_epilogue.py): the slot's biases where HAS_BIAS, the clamped SwiGLU where SWIGLU."""
    slot = slot.to(tl.int64)
    offs_m, pair, row_ok = block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M)
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = tl.arange(0, BLOCK_K // 2)  # byte j of a step: inputs 2j (low nibble) and 2j + 1 (high)
    offs_s = tl.arange(0, BLOCK_K // GROUP)  # the step's groups
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    q_g = q_ptr + slot * stride_qs + offs_n[None, :] * stride_qo + offs_j[:, None]  # [BLOCK_K / 2, BLOCK_N]
    q_u = q_g + I * stride_qo  # up rows follow the gate rows
    s_g = s_ptr + slot * stride_ss + offs_n[None, :] * stride_so + offs_s[:, None]  # [BLOCK_K / GROUP, BLOCK_N]
    s_u = s_g + I * stride_so
    if ROW_SCALE:
        g_row = g_ptr + slot * stride_gs + offs_n
        gs_g = tl.load(g_row, mask=n_ok, other=0.0)[None, :]
        gs_u = tl.load(g_row + I, mask=n_ok, other=0.0)[None, :]
    else:  # never read (_fp4_tiles)
        gs_g = 1.0
        gs_u = 1.0
    w_ty = act_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):  # H % GROUP == 0: a group is in or out whole
        a_lo, a_hi = _even_odd(x_ptrs + k0 * stride_xh, row_ok[:, None] & (offs_k + k0 < H)[None, :], BLOCK_M, BLOCK_K)
        g_lo, g_hi = _fp4_weight_step(q_g, s_g, gs_g, k0, H, n_ok, offs_j, offs_s, GROUP, E8M0, ROW_SCALE, w_ty)
        u_lo, u_hi = _fp4_weight_step(q_u, s_u, gs_u, k0, H, n_ok, offs_j, offs_s, GROUP, E8M0, ROW_SCALE, w_ty)
        if UPCAST:
            a_lo, a_hi = a_lo.to(tl.float32), a_hi.to(tl.float32)
            g_lo, g_hi, u_lo, u_hi = g_lo.to(tl.float32), g_hi.to(tl.float32), u_lo.to(tl.float32), u_hi.to(tl.float32)
        acc_g = tl.dot(a_lo, g_lo, acc_g, input_precision=PRECISION)
        acc_g = tl.dot(a_hi, g_hi, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a_lo, u_lo, acc_u, input_precision=PRECISION)
        acc_u = tl.dot(a_hi, u_hi, acc_u, input_precision=PRECISION)
    # round as the reference does: projections in x's dtype, then the activation
    bias_gate = 0.0
    bias_up = 0.0
    if HAS_BIAS:  # float32 in the row, rounded to the model dtype as the reference adds it
        b_ptrs = b_ptr + slot * stride_bs + offs_n
        bias_gate = tl.load(b_ptrs, mask=n_ok, other=0.0).to(w_ty).to(tl.float32)[None, :]
        bias_up = tl.load(b_ptrs + I, mask=n_ok, other=0.0).to(w_ty).to(tl.float32)[None, :]
    act = gate_up_activation(acc_g, acc_u, bias_gate, bias_up, alpha, limit, w_ty, HAS_BIAS, SWIGLU)
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_an
    tl.store(a_ptrs, act, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "slot_lo", "slot_hi", "slot_shift"])
def _fp4_gate_up_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    g_ptr,
    act_ptr,
    sorted_pairs_ptr,
    block_slot_ptr,
    block_start_ptr,
    num_pairs,
    top_k,
    H,
    I,
    slot_lo,
    slot_hi,
    slot_shift,
    stride_xt,
    stride_xh,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    stride_gs,
    stride_am,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    WINDOWED: tl.constexpr,
    b_ptr,
    stride_bs,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    pid_n = tl.program_id(1)
    if WINDOWED:  # the window's blocks only (aligned_blocks.py)
        first, last = window_blocks(block_start_ptr, slot_lo, slot_hi)
        for pid_m in range(first + tl.program_id(0), last, tl.num_programs(0)):
            slot = tl.load(block_slot_ptr + pid_m) + slot_shift
            _fp4_gate_up_block(
                x_ptr,
                q_ptr,
                s_ptr,
                g_ptr,
                act_ptr,
                sorted_pairs_ptr,
                pid_m,
                pid_n,
                slot,
                num_pairs,
                top_k,
                H,
                I,
                stride_xt,
                stride_xh,
                stride_qs,
                stride_qo,
                stride_ss,
                stride_so,
                stride_gs,
                stride_am,
                stride_an,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                GROUP,
                E8M0,
                ROW_SCALE,
                b_ptr,
                stride_bs,
                alpha,
                limit,
                HAS_BIAS,
                SWIGLU,
            )
    else:
        pid_m = tl.program_id(0)
        slot = tl.load(block_slot_ptr + pid_m)
        if (slot >= slot_lo) & (slot < slot_hi):  # not -1 (past the end), and inside the window
            _fp4_gate_up_block(
                x_ptr,
                q_ptr,
                s_ptr,
                g_ptr,
                act_ptr,
                sorted_pairs_ptr,
                pid_m,
                pid_n,
                slot + slot_shift,
                num_pairs,
                top_k,
                H,
                I,
                stride_xt,
                stride_xh,
                stride_qs,
                stride_qo,
                stride_ss,
                stride_so,
                stride_gs,
                stride_am,
                stride_an,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                GROUP,
                E8M0,
                ROW_SCALE,
                b_ptr,
                stride_bs,
                alpha,
                limit,
                HAS_BIAS,
                SWIGLU,
            )


@triton.jit
def _fp4_down_block(
    act_ptr,
    q_ptr,
    s_ptr,
    g_ptr,
    rows_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    pid_m,
    pid_n,
    slot,
    num_pairs,
    H,
    I,
    stride_am,
    stride_an,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    stride_gs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    b_ptr,
    stride_bs,
    HAS_BIAS: tl.constexpr,
):
    """_fp4_down_kernel's work: block pid_m at slot `slot` (shifted), column tile pid_n."""
    slot = slot.to(tl.int64)
    offs_m, pair, row_ok = block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (H)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)  # reduction over I
    offs_j = tl.arange(0, BLOCK_K // 2)  # two inputs a byte
    offs_s = tl.arange(0, BLOCK_K // GROUP)
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_an
    q_w = q_ptr + slot * stride_qs + offs_n[None, :] * stride_qo + offs_j[:, None]
    s_w = s_ptr + slot * stride_ss + offs_n[None, :] * stride_so + offs_s[:, None]
    if ROW_SCALE:
        gs = tl.load(g_ptr + slot * stride_gs + offs_n, mask=n_ok, other=0.0)[None, :]
    else:  # never read (_fp4_tiles)
        gs = 1.0
    w_ty = act_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        x_lo, x_hi = _even_odd(a_ptrs + k0 * stride_an, row_ok[:, None] & (offs_k + k0 < I)[None, :], BLOCK_M, BLOCK_K)
        w_lo, w_hi = _fp4_weight_step(q_w, s_w, gs, k0, I, n_ok, offs_j, offs_s, GROUP, E8M0, ROW_SCALE, w_ty)
        if UPCAST:
            x_lo, x_hi, w_lo, w_hi = x_lo.to(tl.float32), x_hi.to(tl.float32), w_lo.to(tl.float32), w_hi.to(tl.float32)
        acc = tl.dot(x_lo, w_lo, acc, input_precision=PRECISION)
        acc = tl.dot(x_hi, w_hi, acc, input_precision=PRECISION)
    routing = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    y = acc.to(w_ty).to(tl.float32)
    if HAS_BIAS:  # added and rounded as the reference adds it (the row's float32 bias in the model dtype)
        bias = tl.load(b_ptr + slot * stride_bs + offs_n, mask=n_ok, other=0.0).to(w_ty).to(tl.float32)
        y = (y + bias[None, :]).to(w_ty).to(tl.float32)
    y = y * routing[:, None]
    # rows in a 16-bit dtype (a long step's, kernels/expert_rows_sum.py): the float32 value rounded once, to
    # nearest even
    tl.store(
        rows_ptr + pair[:, None] * H + offs_n[None, :],
        y.to(rows_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit(do_not_specialize=["num_pairs", "slot_lo", "slot_hi", "slot_shift"])
def _fp4_down_kernel(
    act_ptr,
    q_ptr,
    s_ptr,
    g_ptr,
    rows_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_slot_ptr,
    block_start_ptr,
    num_pairs,
    H,
    I,
    slot_lo,
    slot_hi,
    slot_shift,
    stride_am,
    stride_an,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    stride_gs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    WINDOWED: tl.constexpr,
    b_ptr,
    stride_bs,
    HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(1)
    if WINDOWED:  # the window's blocks only (aligned_blocks.py)
        first, last = window_blocks(block_start_ptr, slot_lo, slot_hi)
        for pid_m in range(first + tl.program_id(0), last, tl.num_programs(0)):
            slot = tl.load(block_slot_ptr + pid_m) + slot_shift
            _fp4_down_block(
                act_ptr,
                q_ptr,
                s_ptr,
                g_ptr,
                rows_ptr,
                weights_ptr,
                sorted_pairs_ptr,
                pid_m,
                pid_n,
                slot,
                num_pairs,
                H,
                I,
                stride_am,
                stride_an,
                stride_qs,
                stride_qo,
                stride_ss,
                stride_so,
                stride_gs,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                GROUP,
                E8M0,
                ROW_SCALE,
                b_ptr,
                stride_bs,
                HAS_BIAS,
            )
    else:
        pid_m = tl.program_id(0)
        slot = tl.load(block_slot_ptr + pid_m)
        if (slot >= slot_lo) & (slot < slot_hi):  # not -1 (past the end), and inside the window
            _fp4_down_block(
                act_ptr,
                q_ptr,
                s_ptr,
                g_ptr,
                rows_ptr,
                weights_ptr,
                sorted_pairs_ptr,
                pid_m,
                pid_n,
                slot + slot_shift,
                num_pairs,
                H,
                I,
                stride_am,
                stride_an,
                stride_qs,
                stride_qo,
                stride_ss,
                stride_so,
                stride_gs,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                GROUP,
                E8M0,
                ROW_SCALE,
                b_ptr,
                stride_bs,
                HAS_BIAS,
            )


@triton.jit
def _fp8_gate_up_block(
    x_ptr,
    q_ptr,
    s_ptr,
    act_ptr,
    sorted_pairs_ptr,
    pid_m,
    pid_n,
    slot,
    num_pairs,
    top_k,
    H,
    I,
    up_row_block,
    stride_xt,
    stride_xh,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    stride_am,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """_fp8_gate_up_kernel's work: block pid_m at slot `slot` (shifted), column tile pid_n."""
    slot = slot.to(tl.int64)
    offs_m, pair, row_ok = block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M)
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    q_g = q_ptr + slot * stride_qs + offs_n[None, :] * stride_qo + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    q_u = q_g + I * stride_qo
    # gate row o is in scale row o // 128; up's blocks restart at row I, after gate's ceil(I / 128)
    s_g = s_ptr + slot * stride_ss + (offs_n // 128) * stride_so
    s_u = s_g + up_row_block * stride_so
    w_ty = act_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k + k0 < H
        a = tl.load(x_ptrs + k0 * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        sg = tl.load(s_g + k0 // 128, mask=n_ok, other=0.0)[None, :]
        su = tl.load(s_u + k0 // 128, mask=n_ok, other=0.0)[None, :]
        g = (tl.load(q_g + k0, mask=w_mask, other=0.0).to(tl.float32) * sg).to(w_ty)
        u = (tl.load(q_u + k0, mask=w_mask, other=0.0).to(tl.float32) * su).to(w_ty)
        if UPCAST:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
    gate = acc_g.to(w_ty).to(tl.float32)
    up = acc_u.to(w_ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(w_ty).to(tl.float32)
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_an
    tl.store(a_ptrs, (silu * up).to(w_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "slot_lo", "slot_hi", "slot_shift"])
def _fp8_gate_up_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    act_ptr,
    sorted_pairs_ptr,
    block_slot_ptr,
    block_start_ptr,
    num_pairs,
    top_k,
    H,
    I,
    slot_lo,
    slot_hi,
    slot_shift,
    up_row_block,
    stride_xt,
    stride_xh,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    stride_am,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    tl.static_assert(128 % BLOCK_K == 0, "a step must stay in one column block")
    pid_n = tl.program_id(1)
    if WINDOWED:  # the window's blocks only (aligned_blocks.py)
        first, last = window_blocks(block_start_ptr, slot_lo, slot_hi)
        for pid_m in range(first + tl.program_id(0), last, tl.num_programs(0)):
            slot = tl.load(block_slot_ptr + pid_m) + slot_shift
            _fp8_gate_up_block(
                x_ptr,
                q_ptr,
                s_ptr,
                act_ptr,
                sorted_pairs_ptr,
                pid_m,
                pid_n,
                slot,
                num_pairs,
                top_k,
                H,
                I,
                up_row_block,
                stride_xt,
                stride_xh,
                stride_qs,
                stride_qo,
                stride_ss,
                stride_so,
                stride_am,
                stride_an,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
            )
    else:
        pid_m = tl.program_id(0)
        slot = tl.load(block_slot_ptr + pid_m)
        if (slot >= slot_lo) & (slot < slot_hi):  # not -1 (past the end), and inside the window
            _fp8_gate_up_block(
                x_ptr,
                q_ptr,
                s_ptr,
                act_ptr,
                sorted_pairs_ptr,
                pid_m,
                pid_n,
                slot + slot_shift,
                num_pairs,
                top_k,
                H,
                I,
                up_row_block,
                stride_xt,
                stride_xh,
                stride_qs,
                stride_qo,
                stride_ss,
                stride_so,
                stride_am,
                stride_an,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
            )


@triton.jit
def _fp8_down_block(
    act_ptr,
    q_ptr,
    s_ptr,
    rows_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    pid_m,
    pid_n,
    slot,
    num_pairs,
    H,
    I,
    stride_am,
    stride_an,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """_fp8_down_kernel's work: block pid_m at slot `slot` (shifted), column tile pid_n."""
    slot = slot.to(tl.int64)
    offs_m, pair, row_ok = block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (H)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)  # reduction over I
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_an
    q_w = q_ptr + slot * stride_qs + offs_n[None, :] * stride_qo + offs_k[:, None]
    s_w = s_ptr + slot * stride_ss + (offs_n // 128) * stride_so  # w2 is one part
    w_ty = act_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = offs_k + k0 < I
        a = tl.load(a_ptrs + k0 * stride_an, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        s = tl.load(s_w + k0 // 128, mask=n_ok, other=0.0)[None, :]
        w = (tl.load(q_w + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32) * s).to(w_ty)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    routing = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    y = acc.to(w_ty).to(tl.float32) * routing[:, None]
    # rows in a 16-bit dtype (a long step's, kernels/expert_rows_sum.py): the float32 value rounded once, to
    # nearest even
    tl.store(
        rows_ptr + pair[:, None] * H + offs_n[None, :],
        y.to(rows_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit(do_not_specialize=["num_pairs", "slot_lo", "slot_hi", "slot_shift"])
def _fp8_down_kernel(
    act_ptr,
    q_ptr,
    s_ptr,
    rows_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_slot_ptr,
    block_start_ptr,
    num_pairs,
    H,
    I,
    slot_lo,
    slot_hi,
    slot_shift,
    stride_am,
    stride_an,
    stride_qs,
    stride_qo,
    stride_ss,
    stride_so,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    tl.static_assert(128 % BLOCK_K == 0, "a step must stay in one column block")
    pid_n = tl.program_id(1)
    if WINDOWED:  # the window's blocks only (aligned_blocks.py)
        first, last = window_blocks(block_start_ptr, slot_lo, slot_hi)
        for pid_m in range(first + tl.program_id(0), last, tl.num_programs(0)):
            slot = tl.load(block_slot_ptr + pid_m) + slot_shift
            _fp8_down_block(
                act_ptr,
                q_ptr,
                s_ptr,
                rows_ptr,
                weights_ptr,
                sorted_pairs_ptr,
                pid_m,
                pid_n,
                slot,
                num_pairs,
                H,
                I,
                stride_am,
                stride_an,
                stride_qs,
                stride_qo,
                stride_ss,
                stride_so,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
            )
    else:
        pid_m = tl.program_id(0)
        slot = tl.load(block_slot_ptr + pid_m)
        if (slot >= slot_lo) & (slot < slot_hi):  # not -1 (past the end), and inside the window
            _fp8_down_block(
                act_ptr,
                q_ptr,
                s_ptr,
                rows_ptr,
                weights_ptr,
                sorted_pairs_ptr,
                pid_m,
                pid_n,
                slot + slot_shift,
                num_pairs,
                H,
                I,
                stride_am,
                stride_an,
                stride_qs,
                stride_qo,
                stride_ss,
                stride_so,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
            )


def quantized_grouped_rows_triton(
    x,
    topk_slots,
    topk_weights,
    w13: QuantizedFamily,
    w2: QuantizedFamily,
    rows,
    aligned: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_distinct_slots: int | None = None,
    slot_window: tuple[int, int, int] = SLOT_WINDOW_ALL,
) -> None:
    """`grouped_expert_rows_triton` for quantized slots (same arguments, `aligned` and
    `slot_window` included, same contract)."""
    h = x.shape[1]
    inter = check_quantized_families(h, w13, w2)
    check_rows(rows, x, topk_weights.shape[1])
    launch = grouped_launch(x, topk_slots, topk_weights, w13.num_slots, inter, aligned, max_distinct_slots, slot_window)
    if launch is None:
        return
    if w13.ggml_type is not None:  # GGUF blocks: gguf_expert_gemm.py
        b13, b2, epilogue = quantized_epilogue_args(w13, w2)
        launch_gguf_grouped_kernels(x, w13, w2, rows, launch, b13, b2, epilogue)
        return
    block_k = block_k_for(w13.fmt, launch.meta["BLOCK_M"], x.dtype)
    meta = dict(launch.meta, BLOCK_N=BLOCK_N, BLOCK_K=block_k)  # all four
    act, weights, aligned_args, (lo, hi, shift) = launch.act, launch.weights, launch.aligned_args, launch.window
    num_pairs, top_k = launch.num_pairs, launch.top_k
    up_grid, down_grid = (launch.grid_m, triton.cdiv(inter, BLOCK_N)), (launch.grid_m, triton.cdiv(h, BLOCK_N))
    b13, b2, epilogue = quantized_epilogue_args(w13, w2)
    if w13.fmt in FP4_SCALES:
        fp4 = FP4_SCALES[w13.fmt]
        scaling = dict(GROUP=fp4.group, E8M0=fp4.e8m0, ROW_SCALE=fp4.row_scale)
        # no row scale (mxfp4): the kernels never read g_ptr; any tensor stands in
        g13, g2 = (w13.gscale, w2.gscale) if fp4.row_scale else (w13.scale, w2.scale)
        _fp4_gate_up_kernel[up_grid](
            x,
            w13.q,
            w13.scale,
            g13,
            act,
            *aligned_args,
            num_pairs,
            top_k,
            h,
            inter,
            lo,
            hi,
            shift,
            x.stride(0),
            x.stride(1),
            w13.q.stride(0),
            w13.q.stride(1),
            w13.scale.stride(0),
            w13.scale.stride(1),
            g13.stride(0),
            act.stride(0),
            act.stride(1),
            **meta,
            **scaling,
            b_ptr=b13,
            stride_bs=epilogue["stride_b13"],
            alpha=epilogue["alpha"],
            limit=epilogue["limit"],
            HAS_BIAS=epilogue["HAS_BIAS"],
            SWIGLU=epilogue["SWIGLU"],
        )
        _fp4_down_kernel[down_grid](
            act,
            w2.q,
            w2.scale,
            g2,
            rows,
            weights,
            *aligned_args,
            num_pairs,
            h,
            inter,
            lo,
            hi,
            shift,
            act.stride(0),
            act.stride(1),
            w2.q.stride(0),
            w2.q.stride(1),
            w2.scale.stride(0),
            w2.scale.stride(1),
            g2.stride(0),
            **meta,
            **scaling,
            b_ptr=b2,
            stride_bs=epilogue["stride_b2"],
            HAS_BIAS=epilogue["HAS_BIAS"],
        )
    else:
        _fp8_gate_up_kernel[up_grid](
            x,
            w13.q,
            w13.scale,
            act,
            *aligned_args,
            num_pairs,
            top_k,
            h,
            inter,
            lo,
            hi,
            shift,
            w13.row_blocks_per_part,
            x.stride(0),
            x.stride(1),
            w13.q.stride(0),
            w13.q.stride(1),
            w13.scale.stride(0),
            w13.scale.stride(1),
            act.stride(0),
            act.stride(1),
            **meta,
        )
        _fp8_down_kernel[down_grid](
            act,
            w2.q,
            w2.scale,
            rows,
            weights,
            *aligned_args,
            num_pairs,
            h,
            inter,
            lo,
            hi,
            shift,
            act.stride(0),
            act.stride(1),
            w2.q.stride(0),
            w2.q.stride(1),
            w2.scale.stride(0),
            w2.scale.stride(1),
            **meta,
        )
