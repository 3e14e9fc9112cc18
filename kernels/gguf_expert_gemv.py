"""Routed experts pair by pair (decode) straight from GGUF blocks in their slots, in Triton: the GGUF twins of
quantized_expert_gemv.py's kernels (same contract, grid and epilogue); reference: `quantized_expert_rows_reference`
(kernels/grouped_expert_gemm_reference.py), which decodes the slots with kernels/gguf_blocks.py.

A GGUF family's `q` is uint8 [S, O, row bytes], the file's blocks unchanged with their scales inside, so the
kernels read every weight's code and its block's scales from the same row of bytes, 256 inputs a loop step as a
[rows, 8, 32] tile (`gguf_tile`, gguf_block_decode.py: a 256-value block's eight scales loaded once, not per
weight as `gguf_weights` loads them for the grouped GEMM, gguf_expert_gemm.py). Each weight is decoded to float32 in
registers with the twin's products in the twin's order, rounded to x's dtype as `dequantize_slot` rounds it, and met
with x in float32: the twin's sum, up to the order of the float32 additions. Block types with kernels:
`GGUF_KERNEL_TYPES` (gguf_block_decode.py); the others have only the twin and are refused on CUDA at boot.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ferry.kernels.expert_epilogue import gate_up_activation
from ferry.kernels.gguf_block_decode import GGUF_KERNEL_TYPES, gguf_tile
from ferry.kernels.router_topk import mark_routed_slot

# the pair kernels' outputs a program computes and its warps, for every type (a loop step reads 256 inputs of each
# row, `gguf_tile`: 8 warps hold a tile of 8 rows in 8 registers a thread, where 4 spilled Q6_K's decode)
GGUF_PAIR_TILES = dict(gate_up_rows=8, down_rows=8, warps=8)


@triton.jit
def _gguf_tile_dots(row, x_row, k0, s, i, rows_ok, cols, GGML: tl.constexpr, W_TY: tl.constexpr):
    """[N, 8, 32] products of the weights at inputs k0 + 32 s + i of rows `row` [N, 1, 1] (each rounded to W_TY)
    with x at x_row (inputs from `cols` on read 0)."""
    col = k0 + 32 * s + i
    x = tl.load(x_row + col, mask=col < cols, other=0.0).to(tl.float32)
    return gguf_tile(row, k0, s, i, rows_ok, cols, GGML).to(W_TY).to(tl.float32) * x


# slot_offset follows the layer (the all-resident store passes the layer's first slot): not specialised on
@triton.jit(do_not_specialize=["slot_offset"])
def _gguf_pair_gate_up_kernel(
    x_ptr,
    q_ptr,
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
    BLOCK_N: tl.constexpr,
    GGML: tl.constexpr,
    MARK: tl.constexpr,
    HAS_N_ROWS: tl.constexpr,
    b_ptr,
    stride_bs,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    """GGUF gate/up rows of a pair, with the epilogue of kernels/expert_epilogue.py (the slot's biases where
    HAS_BIAS, the clamped SwiGLU where SWIGLU)."""
    pair = tl.program_id(0)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    if slot < 0:  # skipped pair (another group computes it): leave its row alone
        return
    slot += slot_offset
    token = pair // top_k
    if MARK:  # the resident store's routed table, once a pair (expert_pair_gemv.py's `mark`)
        if tl.program_id(1) == 0:
            mark_routed_slot(table_ptr, n_rows_ptr, slot, token, HAS_N_ROWS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    rows_ok = n_ok[:, None, None]
    s = tl.arange(0, 8)[None, :, None]
    i = tl.arange(0, 32)[None, None, :]
    row_g = q_ptr + slot * stride_qs + offs_n.to(tl.int64)[:, None, None] * stride_qo  # [BLOCK_N, 1, 1]
    row_u = row_g + I * stride_qo  # up rows follow the gate rows
    x_row = x_ptr + token * stride_xt
    w_ty = act_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_N, 8, 32), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, 8, 32), dtype=tl.float32)
    for k0 in range(0, H, 256):
        acc_g += _gguf_tile_dots(row_g, x_row, k0, s, i, rows_ok, H, GGML, w_ty)
        acc_u += _gguf_tile_dots(row_u, x_row, k0, s, i, rows_ok, H, GGML, w_ty)
    bias_gate = 0.0
    bias_up = 0.0
    if HAS_BIAS:  # float32 in the row, rounded to the model dtype as the reference adds it
        b_ptrs = b_ptr + slot * stride_bs + offs_n
        bias_gate = tl.load(b_ptrs, mask=n_ok, other=0.0).to(w_ty).to(tl.float32)
        bias_up = tl.load(b_ptrs + I, mask=n_ok, other=0.0).to(w_ty).to(tl.float32)
    gate = tl.sum(tl.sum(acc_g, axis=2), axis=1)
    up = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    act = gate_up_activation(gate, up, bias_gate, bias_up, alpha, limit, w_ty, HAS_BIAS, SWIGLU)
    tl.store(act_ptr + pair.to(tl.int64) * I + offs_n, act, mask=n_ok)


@triton.jit(do_not_specialize=["slot_offset"])
def _gguf_pair_down_kernel(
    act_ptr,
    q_ptr,
    rows_ptr,
    weights_ptr,
    slots_ptr,
    slot_offset,
    H,
    I,
    stride_qs,
    stride_qo,
    BLOCK_N: tl.constexpr,
    GGML: tl.constexpr,
    b_ptr,
    stride_bs,
    HAS_BIAS: tl.constexpr,
):
    """GGUF down rows of a pair (as _gguf_pair_gate_up_kernel)."""
    pair = tl.program_id(0)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    if slot < 0:
        return
    slot += slot_offset
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (H)
    n_ok = offs_n < H
    s = tl.arange(0, 8)[None, :, None]  # the reduction over I, 256 inputs a step
    i = tl.arange(0, 32)[None, None, :]
    row_w = q_ptr + slot * stride_qs + offs_n.to(tl.int64)[:, None, None] * stride_qo
    a_row = act_ptr + pair.to(tl.int64) * I
    w_ty = act_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, 8, 32), dtype=tl.float32)
    for k0 in range(0, I, 256):
        acc += _gguf_tile_dots(row_w, a_row, k0, s, i, n_ok[:, None, None], I, GGML, w_ty)
    y = tl.sum(tl.sum(acc, axis=2), axis=1).to(w_ty).to(tl.float32)
    if HAS_BIAS:  # added and rounded as the reference adds it
        bias = tl.load(b_ptr + slot * stride_bs + offs_n, mask=n_ok, other=0.0).to(w_ty).to(tl.float32)
        y = (y + bias).to(w_ty).to(tl.float32)
    routing = tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(rows_ptr + pair.to(tl.int64) * H + offs_n, y * routing, mask=n_ok)


def launch_gguf_pair_kernels(x, w13, w2, act, rows, weights, slots, slot_offset, top_k, table, n_rows, marking,
                             b13, b2, epilogue) -> None:  # fmt: skip
    """The two pair kernels over GGUF families (quantized_pair_rows_triton checked them and made `act`)."""
    num_pairs, (inter, h) = act.shape[0], (w2.cols, x.shape[1])
    tiles = GGUF_PAIR_TILES
    _gguf_pair_gate_up_kernel[(num_pairs, triton.cdiv(inter, tiles["gate_up_rows"]))](
        x,
        w13.q,
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
        BLOCK_N=tiles["gate_up_rows"],
        GGML=GGUF_KERNEL_TYPES[w13.ggml_type],
        **marking,
        b_ptr=b13,
        stride_bs=epilogue["stride_b13"],
        alpha=epilogue["alpha"],
        limit=epilogue["limit"],
        HAS_BIAS=epilogue["HAS_BIAS"],
        SWIGLU=epilogue["SWIGLU"],
        num_warps=tiles["warps"],
    )
    _gguf_pair_down_kernel[(num_pairs, triton.cdiv(h, tiles["down_rows"]))](
        act,
        w2.q,
        rows,
        weights,
        slots,
        slot_offset,
        h,
        inter,
        w2.q.stride(0),
        w2.q.stride(1),
        BLOCK_N=tiles["down_rows"],
        GGML=GGUF_KERNEL_TYPES[w2.ggml_type],
        b_ptr=b2,
        stride_bs=epilogue["stride_b2"],
        HAS_BIAS=epilogue["HAS_BIAS"],
        num_warps=tiles["warps"],
    )
