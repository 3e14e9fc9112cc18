"""Routed experts for small steps (decode), one matrix-vector product per (token, k) pair, in Triton.

Twin of `kernels/grouped_expert_gemm_reference.py` (same contract as `grouped_expert_rows`): for every pair with a
slot s >= 0, rows[t, k] = w[t, k] * W2[s] (silu(G[s] x_t) * (U[s] x_t)).

Why a second kernel: the grouped GEMM sorts pairs by slot so that one program multiplies one
expert's weights by many tokens. A decode step has a handful of pairs, each expert mostly hit once,
and making that alignment costs ~25 tiny launches (or a host round trip) per layer, more time than
the matrix products. Here every program reads its pair's slot straight from `topk_slots` (no
alignment at all) and computes a block of output features for that one pair: two launches per
call, gate/up with the SiLU product fused, then down with the routing weight fused. Weight rows are
read contiguously (W13[s] is [2I, H], W2[s] is [H, I]: both reduce along their last, unit-stride
axis). Each pair's result depends only on its own slot's weights and token, so an offloading store
computing a layer in groups and an all-resident store computing it at once agree bit for bit, as
long as both pick this kernel for the same step size (`use_pair_kernel`).

Rounding follows the reference: projections rounded to the weights' dtype, silu and the product
rounded, the down projection rounded, then multiplied by the routing weight in float32. Slots of experts
with biases and the clamped SwiGLU (EpilogueFamily views, kernels/expert_epilogue.py) add and round them
where the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.dense_gemv import row_block_dot
from ferry.kernels.expert_epilogue import gate_up_activation, triton_epilogue_args
from ferry.kernels.pair_tiles import TILES
from ferry.kernels.quantized_expert_gemv import quantized_pair_rows_triton
from ferry.kernels.quantized_experts import QuantizedFamily
from ferry.kernels.router_topk import mark_args, mark_routed_slot
from ferry.plan.expert_formats import BF16

# Above this many (token, k) pairs a step reads each expert's weights once per pair here, but once
# per block of tokens in the grouped GEMM: past a few tokens per expert the grouped GEMM wins. Both
# expert stores must decide by the same number (it selects the rounding order), hence one function.
PAIR_KERNEL_MAX_PAIRS = 64


def use_pair_kernel(num_pairs: int) -> bool:
    """Whether a step of `num_pairs` (token, k) pairs is computed pair by pair on the GPU."""
    return 0 < num_pairs <= PAIR_KERNEL_MAX_PAIRS


@triton.jit
def _pair_gate_up_kernel(
    x_ptr,
    w13_ptr,
    b13_ptr,
    act_ptr,
    slots_ptr,
    slot_offset,
    top_k,
    H,
    I,
    table_ptr,
    n_rows_ptr,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_b13,
    alpha,
    limit,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MARK: tl.constexpr,
    HAS_N_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    pair = tl.program_id(0)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    if slot < 0:  # skipped pair (another group computes it): leave its row alone
        return
    slot += slot_offset
    token = pair // top_k
    if MARK:  # the resident store's routed table (see `mark`), once a pair
        if tl.program_id(1) == 0:
            mark_routed_slot(table_ptr, n_rows_ptr, slot, token, HAS_N_ROWS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + token * stride_xt
    g_ptrs = w13_ptr + slot * stride_ws + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k + k0 < H
        a = tl.load(x_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        mask = n_ok[:, None] & k_ok[None, :]
        g = tl.load(g_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
        acc_g += g * a[None, :]
        acc_u += u * a[None, :]
    bias_gate = 0.0
    bias_up = 0.0
    if HAS_BIAS:
        b_ptrs = b13_ptr + slot * stride_b13 + offs_n
        bias_gate = tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)
        bias_up = tl.load(b_ptrs + I, mask=n_ok, other=0.0).to(tl.float32)
    out_ty = act_ptr.dtype.element_ty
    gate, up = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    act = gate_up_activation(gate, up, bias_gate, bias_up, alpha, limit, out_ty, HAS_BIAS, SWIGLU)
    tl.store(act_ptr + pair.to(tl.int64) * I + offs_n, act, mask=n_ok)


@triton.jit
def _pair_down_kernel(
    act_ptr,
    w2_ptr,
    b2_ptr,
    rows_ptr,
    weights_ptr,
    slots_ptr,
    slot_offset,
    H,
    I,
    stride_ws,
    stride_wh,
    stride_b2,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pair = tl.program_id(0)
    slot = tl.load(slots_ptr + pair).to(tl.int64)
    if slot < 0:
        return
    slot += slot_offset
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (H)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)  # reduction over I
    a_row = act_ptr + pair.to(tl.int64) * I
    w_ptrs = w2_ptr + slot * stride_ws + offs_n[:, None].to(tl.int64) * stride_wh + offs_k[None, :]
    y = row_block_dot(a_row, w_ptrs, n_ok, I, BLOCK_N, BLOCK_K).to(act_ptr.dtype.element_ty).to(tl.float32)
    if HAS_BIAS:  # added and rounded as the reference adds it
        bias = tl.load(b2_ptr + slot * stride_b2 + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        y = (y + bias).to(act_ptr.dtype.element_ty).to(tl.float32)
    routing = tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(rows_ptr + pair.to(tl.int64) * H + offs_n, y * routing, mask=n_ok)


def expert_pair_rows_triton(
    x,
    topk_slots,
    topk_weights,
    w13,
    w2,
    rows,
    slot_offset: int = 0,
    mark: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> None:
    """Same contract as `grouped_expert_rows_reference`, plus `slot_offset`: the slot of a pair is
    topk_slots + slot_offset (pairs whose topk_slots is -1 are skipped), so the all-resident store
    can pass a layer's expert ids unchanged instead of launching an add. `mark` (table, n_rows):
    also set table.view(-1)[slot] = 1 for every pair of a row < n_rows (n_rows int32 [1] on the
    device, or None: every row), `mark_routed` for the resident store, whose slots index its
    [layers, E] table, done by the gate/up kernel instead of a launch of its own. Quantized slots
    (`QuantizedFamily` w13, w2) go to their twin, quantized_expert_gemv.py."""
    table, n_rows = mark_args(mark, rows)
    if isinstance(w13, QuantizedFamily):
        return quantized_pair_rows_triton(x, topk_slots, topk_weights, w13, w2, rows, slot_offset, mark)
    w13, w2, b13, b2, epilogue = triton_epilogue_args(w13, w2)
    t, h = x.shape
    top_k = topk_slots.shape[1]
    inter = w2.shape[2]
    if rows.dtype != torch.float32 or tuple(rows.shape) != (t, top_k, h) or not rows.is_contiguous():
        raise ValueError(f"rows must be a contiguous float32 [{t}, {top_k}, {h}] tensor")
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1 or w13.stride(1) != h or w2.stride(1) != inter:
        raise ValueError("x rows and each slot's weight rows must be contiguous")
    num_pairs = t * top_k
    if num_pairs == 0:
        return
    slots = topk_slots if topk_slots.is_contiguous() else topk_slots.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    tiles = TILES[BF16]
    _pair_gate_up_kernel[(num_pairs, triton.cdiv(inter, tiles.gate_up_rows))](
        x,
        w13,
        b13,
        act,
        slots,
        slot_offset,
        top_k,
        h,
        inter,
        table,
        n_rows,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        epilogue["stride_b13"],
        epilogue["alpha"],
        epilogue["limit"],
        BLOCK_N=tiles.gate_up_rows,
        BLOCK_K=tiles.gate_up_k,
        num_warps=tiles.gate_up_warps,
        MARK=mark is not None,
        HAS_N_ROWS=mark is not None and mark[1] is not None,
        HAS_BIAS=epilogue["HAS_BIAS"],
        SWIGLU=epilogue["SWIGLU"],
    )
    _pair_down_kernel[(num_pairs, triton.cdiv(h, tiles.down_rows))](
        act,
        w2,
        b2,
        rows,
        weights,
        slots,
        slot_offset,
        h,
        inter,
        w2.stride(0),
        w2.stride(1),
        epilogue["stride_b2"],
        BLOCK_N=tiles.down_rows,
        BLOCK_K=tiles.down_k,
        num_warps=tiles.down_warps,
        HAS_BIAS=epilogue["HAS_BIAS"],
    )
