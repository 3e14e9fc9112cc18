"""Grouped expert GEMM by slot straight from GGUF blocks in their slots, in Triton: the GGUF twins of
quantized_expert_gemm.py's kernels (same alignment, grid, slot window, epilogue and rounding); reference:
`quantized_expert_rows_reference` (kernels/grouped_expert_gemm_reference.py).

Each program decodes its slot's weight tile [BLOCK_K, BLOCK_N] in registers (`gguf_weights`,
gguf_block_decode.py: every weight the twin's float32 value, rounded to x's dtype as `dequantize_slot` rounds it)
and feeds it to tl.dot with BLOCK_M of the slot's tokens, so every block's bytes are read once per block of tokens
and no dense copy of the weights exists. A weight's code and its block's scales are loaded per weight (gathers
within the tile's rows): correct for every type and shape, not yet tuned.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ferry.kernels.aligned_blocks import block_rows, window_blocks
from ferry.kernels.expert_epilogue import gate_up_activation
from ferry.kernels.gguf_block_decode import GGUF_KERNEL_TYPES, gguf_weights

# a step decodes a [BLOCK_K, BLOCK_N] tile of weights twice (gate, up), each weight with its block's scales: at
# 32 x 64 over 8 warps no thread spills (64 x 64 over 4 spilled ~1.2 KB a thread at sm_90; not timed yet)
GGUF_BLOCK_N = 64
GGUF_BLOCK_K = 32
GGUF_NUM_WARPS = 8


@triton.jit
def _gguf_gate_up_block(
    x_ptr,
    q_ptr,
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
    stride_am,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    GGML: tl.constexpr,
    b_ptr,
    stride_bs,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    """_gguf_gate_up_kernel's work: block pid_m at slot `slot` (shifted), column tile pid_n; the epilogue
    (kernels/expert_epilogue.py): the slot's biases where HAS_BIAS, the clamped SwiGLU where SWIGLU."""
    slot = slot.to(tl.int64)
    offs_m, pair, row_ok = block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M)
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    row_g = q_ptr + slot * stride_qs + offs_n.to(tl.int64)[None, :] * stride_qo  # [1, BLOCK_N]
    row_u = row_g + I * stride_qo  # up rows follow the gate rows
    w_ty = act_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k + k0 < H
        a = tl.load(x_ptrs + k0 * stride_xh, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        cols = (offs_k + k0)[:, None]  # [BLOCK_K, 1]
        g = gguf_weights(row_g, cols, w_mask, GGML).to(w_ty)
        u = gguf_weights(row_u, cols, w_mask, GGML).to(w_ty)
        if UPCAST:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
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
def _gguf_gate_up_kernel(
    x_ptr,
    q_ptr,
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
    stride_am,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    GGML: tl.constexpr,
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
            _gguf_gate_up_block(
                x_ptr,
                q_ptr,
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
                stride_am,
                stride_an,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                GGML,
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
            _gguf_gate_up_block(
                x_ptr,
                q_ptr,
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
                stride_am,
                stride_an,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                GGML,
                b_ptr,
                stride_bs,
                alpha,
                limit,
                HAS_BIAS,
                SWIGLU,
            )


@triton.jit
def _gguf_down_block(
    act_ptr,
    q_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    GGML: tl.constexpr,
    b_ptr,
    stride_bs,
    HAS_BIAS: tl.constexpr,
):
    """_gguf_down_kernel's work: block pid_m at slot `slot` (shifted), column tile pid_n."""
    slot = slot.to(tl.int64)
    offs_m, pair, row_ok = block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (H)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)  # reduction over I
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_an
    row_w = q_ptr + slot * stride_qs + offs_n.to(tl.int64)[None, :] * stride_qo
    w_ty = act_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = offs_k + k0 < I
        a = tl.load(a_ptrs + k0 * stride_an, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = gguf_weights(row_w, (offs_k + k0)[:, None], k_ok[:, None] & n_ok[None, :], GGML).to(w_ty)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
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
def _gguf_down_kernel(
    act_ptr,
    q_ptr,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    GGML: tl.constexpr,
    b_ptr,
    stride_bs,
    HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(1)
    if WINDOWED:  # the window's blocks only (aligned_blocks.py)
        first, last = window_blocks(block_start_ptr, slot_lo, slot_hi)
        for pid_m in range(first + tl.program_id(0), last, tl.num_programs(0)):
            slot = tl.load(block_slot_ptr + pid_m) + slot_shift
            _gguf_down_block(
                act_ptr,
                q_ptr,
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
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                GGML,
                b_ptr,
                stride_bs,
                HAS_BIAS,
            )
    else:
        pid_m = tl.program_id(0)
        slot = tl.load(block_slot_ptr + pid_m)
        if (slot >= slot_lo) & (slot < slot_hi):  # not -1 (past the end), and inside the window
            _gguf_down_block(
                act_ptr,
                q_ptr,
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
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                GGML,
                b_ptr,
                stride_bs,
                HAS_BIAS,
            )


def launch_gguf_grouped_kernels(x, w13, w2, rows, launch, b13, b2, epilogue) -> None:
    """The two grouped kernels over GGUF families (quantized_grouped_rows_triton checked them and made `launch`)."""
    h, inter = x.shape[1], w2.cols
    meta = dict(launch.meta, BLOCK_N=GGUF_BLOCK_N, BLOCK_K=GGUF_BLOCK_K, num_warps=GGUF_NUM_WARPS)
    act, weights, aligned_args, (lo, hi, shift) = launch.act, launch.weights, launch.aligned_args, launch.window
    up_grid = (launch.grid_m, triton.cdiv(inter, GGUF_BLOCK_N))
    down_grid = (launch.grid_m, triton.cdiv(h, GGUF_BLOCK_N))
    _gguf_gate_up_kernel[up_grid](
        x,
        w13.q,
        act,
        *aligned_args,
        launch.num_pairs,
        launch.top_k,
        h,
        inter,
        lo,
        hi,
        shift,
        x.stride(0),
        x.stride(1),
        w13.q.stride(0),
        w13.q.stride(1),
        act.stride(0),
        act.stride(1),
        **meta,
        GGML=GGUF_KERNEL_TYPES[w13.ggml_type],
        b_ptr=b13,
        stride_bs=epilogue["stride_b13"],
        alpha=epilogue["alpha"],
        limit=epilogue["limit"],
        HAS_BIAS=epilogue["HAS_BIAS"],
        SWIGLU=epilogue["SWIGLU"],
    )
    _gguf_down_kernel[down_grid](
        act,
        w2.q,
        rows,
        weights,
        *aligned_args,
        launch.num_pairs,
        h,
        inter,
        lo,
        hi,
        shift,
        act.stride(0),
        act.stride(1),
        w2.q.stride(0),
        w2.q.stride(1),
        **meta,
        GGML=GGUF_KERNEL_TYPES[w2.ggml_type],
        b_ptr=b2,
        stride_bs=epilogue["stride_b2"],
        HAS_BIAS=epilogue["HAS_BIAS"],
    )
