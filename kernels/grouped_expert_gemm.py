"""Grouped expert GEMM by slot, in Triton; twin: `kernels/grouped_expert_gemm_reference.py`.

For every (token, k) pair with a slot s >= 0: rows[t, k] = w[t, k] * W2[s] (silu(G[s] x) * (U[s] x)),
where W13[s] = [G; U] (with biases and the clamped SwiGLU where the slots are EpilogueFamily views:
kernels/expert_epilogue.py). Pairs are sorted by slot and each slot's pairs padded to BLOCK_M rows
(the layout vLLM's fused MoE calls "aligned"), so every program multiplies one slot's weights by
up to BLOCK_M of its tokens. Two kernels: gate/up with the SiLU product fused, then down with
the routing weight fused. Rows are summed over k in k order afterwards (no atomics), as the
reference does, so the result does not depend on slot numbering.

The alignment is computed on the device without a host round trip; its grid is the worst case
(ceil(pairs / BLOCK_M) + one partial block per distinct slot), and blocks past the real ones
exit at once. On CUDA that alignment is four Triton launches (kernels/align_pairs.py; its torch twin,
`align_pairs_by_slot_reference`, is two dozen small kernels). A caller that has the routing on the host
anyway (the offload store, which needs it for its policy) aligns there instead with
`align_pairs_by_slot_host` (align_pairs.py): one small copy. The blocks' size and which of them a launch
covers: kernels/aligned_blocks.py, shared with the quantized twin.
`grouped_expert_forward` dispatches: CUDA -> Triton (pair by pair for small steps, see
expert_pair_gemv.py), anything else -> reference. Quantized slots (`QuantizedFamily`,
kernels/quantized_experts.py) take the same paths, each entry handing them to its quantized twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.aligned_blocks import SLOT_WINDOW_ALL, block_rows, grouped_launch, window_blocks
from ferry.kernels.dispatch import use_triton
from ferry.kernels.expert_epilogue import gate_up_activation, triton_epilogue_args
from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton, use_pair_kernel
from ferry.kernels.expert_rows_sum import check_rows, new_rows, sum_rows
from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_rows_reference
from ferry.kernels.quantized_expert_gemm import quantized_grouped_rows_triton
from ferry.kernels.quantized_experts import QuantizedFamily


@triton.jit
def _gate_up_block(
    x_ptr,
    w13_ptr,
    b13_ptr,
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
    stride_ws,
    stride_wn,
    stride_wh,
    stride_b13,
    alpha,
    limit,
    stride_am,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    """Block pid_m's rows times slot `slot`'s gate/up tile pid_n, its activation (expert_epilogue.py: with
    the slot's biases where HAS_BIAS, the clamped SwiGLU where SWIGLU) stored to act."""
    offs_m, pair, row_ok = block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M)
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    w_base = w13_ptr + slot.to(tl.int64) * stride_ws
    g_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k + k0 < H
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    # round as the reference does: projections in the weights' dtype, then the activation
    bias_gate = 0.0
    bias_up = 0.0
    if HAS_BIAS:
        b_ptrs = b13_ptr + slot.to(tl.int64) * stride_b13 + offs_n
        bias_gate = tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        bias_up = tl.load(b_ptrs + I, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = act_ptr.dtype.element_ty
    act = gate_up_activation(acc_g, acc_u, bias_gate, bias_up, alpha, limit, out_ty, HAS_BIAS, SWIGLU)
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :] * stride_an
    tl.store(a_ptrs, act, mask=row_ok[:, None] & n_ok[None, :])


# num_pairs follows the step's token count: not specialised on, so a step of a new size class never
# compiles a new variant mid-serving (warmup.py runs the classes that remain at boot); nor is the
# slot window (slot_lo <= block_slot < slot_hi computes, at slot block_slot + slot_shift), which
# follows a streamed chunk. WINDOWED: the grid's first axis is not one program a block but a few that
# loop over the window's blocks only, [block_start[slot_lo], block_start[slot_hi]) read on the device
# (a streamed chunk's blocks are a few per cent of its layer's; a grid over all of them launched the
# rest to exit at once, ~1,100 row blocks x 8-32 column tiles a launch, two launches a ring chunk).
@triton.jit(do_not_specialize=["num_pairs", "slot_lo", "slot_hi", "slot_shift"])
def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    b13_ptr,
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
    stride_ws,
    stride_wn,
    stride_wh,
    stride_b13,
    alpha,
    limit,
    stride_am,
    stride_an,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,
):
    pid_n = tl.program_id(1)
    if WINDOWED:
        first, last = window_blocks(block_start_ptr, slot_lo, slot_hi)
        for pid_m in range(first + tl.program_id(0), last, tl.num_programs(0)):
            slot = tl.load(block_slot_ptr + pid_m) + slot_shift
            _gate_up_block(
                x_ptr,
                w13_ptr,
                b13_ptr,
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
                stride_ws,
                stride_wn,
                stride_wh,
                stride_b13,
                alpha,
                limit,
                stride_am,
                stride_an,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                HAS_BIAS,
                SWIGLU,
            )
    else:
        pid_m = tl.program_id(0)
        slot = tl.load(block_slot_ptr + pid_m)
        if (slot >= slot_lo) & (slot < slot_hi):  # not -1 (past the end), and inside the caller's window
            _gate_up_block(
                x_ptr,
                w13_ptr,
                b13_ptr,
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
                stride_ws,
                stride_wn,
                stride_wh,
                stride_b13,
                alpha,
                limit,
                stride_am,
                stride_an,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                HAS_BIAS,
                SWIGLU,
            )


@triton.jit
def _down_block(
    act_ptr,
    w2_ptr,
    b2_ptr,
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
    stride_ws,
    stride_wh,
    stride_wi,
    stride_b2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Block pid_m's activations times slot `slot`'s down tile pid_n (plus its bias where HAS_BIAS, rounded as
    the reference adds it), weighted, stored to its pairs' rows."""
    offs_m, pair, row_ok = block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features (H)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)  # reduction over I
    a_ptrs = act_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_an
    w_ptrs = w2_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :] * stride_wh + offs_k[:, None] * stride_wi
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = offs_k + k0 < I
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_an
        w_ptrs += BLOCK_K * stride_wi
    routing = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b2_ptr + slot.to(tl.int64) * stride_b2 + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        y = (y + bias[None, :]).to(act_ptr.dtype.element_ty).to(tl.float32)
    y = y * routing[:, None]
    # rows in a 16-bit dtype (a long step's, kernels/expert_rows_sum.py): the float32 value rounded once, to
    # nearest even
    tl.store(
        rows_ptr + pair[:, None] * H + offs_n[None, :],
        y.to(rows_ptr.dtype.element_ty),
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit(do_not_specialize=["num_pairs", "slot_lo", "slot_hi", "slot_shift"])
def _down_kernel(
    act_ptr,
    w2_ptr,
    b2_ptr,
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
    stride_ws,
    stride_wh,
    stride_wi,
    stride_b2,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(1)
    if WINDOWED:
        first, last = window_blocks(block_start_ptr, slot_lo, slot_hi)
        for pid_m in range(first + tl.program_id(0), last, tl.num_programs(0)):
            slot = tl.load(block_slot_ptr + pid_m) + slot_shift
            _down_block(
                act_ptr,
                w2_ptr,
                b2_ptr,
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
                stride_ws,
                stride_wh,
                stride_wi,
                stride_b2,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                HAS_BIAS,
            )
    else:
        pid_m = tl.program_id(0)
        slot = tl.load(block_slot_ptr + pid_m)
        if (slot >= slot_lo) & (slot < slot_hi):
            _down_block(
                act_ptr,
                w2_ptr,
                b2_ptr,
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
                stride_ws,
                stride_wh,
                stride_wi,
                stride_b2,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                UPCAST,
                PRECISION,
                HAS_BIAS,
            )


def grouped_expert_rows_triton(
    x,
    topk_slots,
    topk_weights,
    w13,
    w2,
    rows,
    aligned: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_distinct_slots: int | None = None,
    slot_window: tuple[int, int, int] = SLOT_WINDOW_ALL,
) -> None:
    """Triton twin of `grouped_expert_rows_reference` (same arguments, same contract).

    `aligned`: (sorted_pairs, block_slot) already on the device, made with BLOCK_M =
    block_m_for(T * k) (e.g. by `align_pairs_by_slot_host`); `topk_slots` is then not read.
    `slot_window` (lo, hi, shift): only the blocks whose block_slot b has lo <= b < hi are
    computed, with the weights of slot b + shift (a streamed chunk: its experts' positions in the
    layer's list, and the staging slots they landed in), with no tensor made per chunk. With the
    block starts in `aligned` (`align_pairs_by_slot(..., block_starts=True)`), a window's launch is
    sized for its own blocks (`window_programs`, aligned_blocks.py), read on the device, not for the layer's.
    Quantized slots (`QuantizedFamily` w13, w2) go to their twin, quantized_expert_gemm.py."""
    if isinstance(w13, QuantizedFamily):
        return quantized_grouped_rows_triton(
            x, topk_slots, topk_weights, w13, w2, rows, aligned, max_distinct_slots, slot_window
        )
    w13, w2, b13, b2, epilogue = triton_epilogue_args(w13, w2)
    h = x.shape[1]
    inter = w2.shape[2]
    check_rows(rows, x, topk_weights.shape[1])
    launch = grouped_launch(x, topk_slots, topk_weights, w13.shape[0], inter, aligned, max_distinct_slots, slot_window)
    if launch is None:
        return
    block_n, block_k = 64, 64
    meta = dict(launch.meta, BLOCK_N=block_n, BLOCK_K=block_k)  # both kernels
    act, (lo, hi, shift), grid_m = launch.act, launch.window, launch.grid_m
    _gate_up_kernel[(grid_m, triton.cdiv(inter, block_n))](
        x,
        w13,
        b13,
        act,
        *launch.aligned_args,
        launch.num_pairs,
        launch.top_k,
        h,
        inter,
        lo,
        hi,
        shift,
        x.stride(0),
        x.stride(1),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        epilogue["stride_b13"],
        epilogue["alpha"],
        epilogue["limit"],
        act.stride(0),
        act.stride(1),
        **meta,
        HAS_BIAS=epilogue["HAS_BIAS"],
        SWIGLU=epilogue["SWIGLU"],
    )
    _down_kernel[(grid_m, triton.cdiv(h, block_n))](
        act,
        w2,
        b2,
        rows,
        launch.weights,
        *launch.aligned_args,
        launch.num_pairs,
        h,
        inter,
        lo,
        hi,
        shift,
        act.stride(0),
        act.stride(1),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        epilogue["stride_b2"],
        **meta,
        HAS_BIAS=epilogue["HAS_BIAS"],
    )


def grouped_expert_rows(x, topk_slots, topk_weights, w13, w2, rows, max_distinct_slots: int | None = None) -> None:
    """rows[t, k] = weighted output of pair (t, k) for every pair whose slot is >= 0.
    Small steps go pair by pair (expert_pair_gemv.py: no alignment), larger ones grouped by slot."""
    if use_triton(x) and use_pair_kernel(topk_slots.numel()):
        expert_pair_rows_triton(x, topk_slots, topk_weights, w13, w2, rows)
    elif use_triton(x):
        grouped_expert_rows_triton(x, topk_slots, topk_weights, w13, w2, rows, max_distinct_slots=max_distinct_slots)
    else:
        grouped_expert_rows_reference(x, topk_slots, topk_weights, w13, w2, rows)


def grouped_expert_forward(x, topk_slots, topk_weights, w13, w2, max_distinct_slots: int | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_slots[t, k]}(x[t]): [T, H] in x's dtype."""
    rows = new_rows(x, topk_slots.shape[1], zeroed=True)
    grouped_expert_rows(x, topk_slots, topk_weights, w13, w2, rows, max_distinct_slots)
    return sum_rows(rows, x.dtype)  # as the offload store finishes: same bits
