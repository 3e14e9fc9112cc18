"""The Gated DeltaNet's short conv over a prefill step's requests (depthwise causal conv1d, carried
state, SiLU) in two Triton launches; the torch twin (causal_conv1d_reference.py) elsewhere.

The twin loops over the step's requests in Python, and each request costs a transposing `cat` of
its state and inputs, torch's generic depthwise conv, the SiLU and a state copy: profiled at 8,192
tokens of the 35B (8,192 channels, kernel 4), the cat and the conv alone took ~1.9 ms a layer,
where the bytes (the inputs read once, the outputs written once: 2 x 134 MB) take
~70 µs of HBM. Here:

1. `_conv_prefill_kernel`, grid (request, block of BLOCK_T of its tokens, block of BLOCK_C channels):
   output token t of channel c sums the K taps in(t - K + 1 .. t), where in(tau) is the request's
   input tau for tau >= 0 and its conv state (its last K - 1 inputs, oldest first) for tau < 0;
   only a request's first time block reads the state, in a second pass over the taps (one tile of
   pointers live at a time: with both sources in one pass the compiled kernel spilled 648 bytes a
   thread). The window is rounded to the weight's dtype (as the twin's `cat` is), the sum
   accumulates in float32 (as the CUDA conv kernels do) and is rounded to the weight's dtype, then
   SiLU, rounded again: the twin's roundings, within one bf16 rounding of its products.
2. `_conv_state_kernel`, grid (request, block of channels): the request's new state, its last K - 1
   inputs (taken from the old state where the request brought fewer than K - 1 tokens), written in
   place. A second launch because every time block of kernel 1 may read the old state; the end of
   a launch is the grid-wide "everyone has read it".

The requests' first rows and state slots are read on the device (`query_start`, `state_slots`), so
one compiled variant serves every step; only the grid depends on the longest request (its time
blocks past a shorter request's end return at once)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.causal_conv1d_reference import (
    causal_conv1d_decode,
    causal_conv1d_varlen_reference,
    causal_conv1d_with_state,
    conv_state_after,
)
from ferry.kernels.dispatch import use_triton

__all__ = ["causal_conv1d_decode", "causal_conv1d_varlen", "causal_conv1d_with_state", "conv_state_after"]

BLOCK_T = 32  # tokens a program (each reads its K - 1 tokens before too: 1.1x the inputs at 32)
BLOCK_C = 128  # channels a program: 256-byte rows of bf16 inputs


def causal_conv1d_varlen(
    x: torch.Tensor,  # [T, channels], all requests' new inputs, request after request (rows may be strided)
    conv_states: torch.Tensor,  # [slots, channels, kernel - 1], updated in place
    state_slots: list[int],
    query_lens: list[int],
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None = None,
    *,
    slots_on_device: torch.Tensor | None = None,  # int [R]: state_slots, on x's device
    query_start: torch.Tensor | None = None,  # int32 [R + 1]: each request's first row, on x's device
) -> torch.Tensor:
    """SiLU(conv) of every request's new inputs [T, channels], each continuing from its conv state,
    which is left holding the request's last kernel - 1 inputs. On CUDA, given the step's slots and
    first rows on the device, the Triton kernels (no bias); else the twin."""
    if use_triton(x) and bias is None and slots_on_device is not None and query_start is not None and query_lens:
        return causal_conv1d_varlen_triton(x, conv_states, slots_on_device, query_start, max(query_lens), weight)
    return causal_conv1d_varlen_reference(x, conv_states, state_slots, query_lens, weight, bias)


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    slots_on_device: torch.Tensor,
    query_start: torch.Tensor,
    longest: int,
    weight: torch.Tensor,
) -> torch.Tensor:
    t, channels = x.shape
    kernel = weight.shape[1]
    if x.stride(1) != 1 or conv_states.stride(2) != 1 or weight.stride(1) != 1:
        raise ValueError("causal_conv1d_varlen_triton: channels, taps and state taps must be contiguous")
    if conv_states.shape[1:] != (channels, kernel - 1):
        raise ValueError(f"conv states {tuple(conv_states.shape)} do not hold {channels} channels x {kernel - 1} taps")
    out = torch.empty((t, channels), dtype=x.dtype, device=x.device)
    requests = query_start.shape[0] - 1
    if requests == 0 or t == 0:
        return out
    c_blocks = triton.cdiv(channels, BLOCK_C)
    if longest > 0:
        _conv_prefill_kernel[(requests, triton.cdiv(longest, BLOCK_T), c_blocks)](
            x,
            conv_states,
            slots_on_device,
            query_start,
            weight,
            out,
            channels,
            x.stride(0),
            conv_states.stride(0),
            conv_states.stride(1),
            weight.stride(0),
            KERNEL=kernel,
            BLOCK_T=BLOCK_T,
            BLOCK_C=BLOCK_C,
        )
    _conv_state_kernel[(requests, c_blocks)](
        x,
        conv_states,
        slots_on_device,
        query_start,
        weight,
        channels,
        x.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        KERNEL=kernel,
        BLOCK_K=triton.next_power_of_2(kernel),
        BLOCK_C=BLOCK_C,
    )
    return out


@triton.jit
def _conv_prefill_kernel(
    x_ptr,
    conv_ptr,
    slot_ptr,
    start_ptr,
    w_ptr,
    out_ptr,
    C,
    stride_x,
    stride_cs,
    stride_cc,
    stride_wc,
    KERNEL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    tl.static_assert(KERNEL - 1 <= BLOCK_T)  # only the first time block reads the state
    r = tl.program_id(0)
    first = tl.load(start_ptr + r).to(tl.int64)
    length = tl.load(start_ptr + r + 1) - tl.load(start_ptr + r)
    if tl.program_id(1) * BLOCK_T >= length:  # the grid covers the longest request: past this one's end
        return
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # the request's own positions
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    rows, okc = t < length, c < C
    w_ty = w_ptr.dtype.element_ty
    x_rows = x_ptr + first * stride_x
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KERNEL):  # the taps reading this request's inputs (tau >= 0)
        tau = t - (KERNEL - 1) + j
        xv = tl.load(
            x_rows + tau.to(tl.int64)[:, None] * stride_x + c[None, :],
            mask=(rows & (tau >= 0))[:, None] & okc[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + c * stride_wc + j, mask=okc, other=0.0).to(tl.float32)
        acc += xv.to(w_ty).to(tl.float32) * w[None, :]
    if tl.program_id(1) == 0:  # only a request's first K - 1 positions read its conv state (tau < 0)
        state = conv_ptr + tl.load(slot_ptr + r).to(tl.int64) * stride_cs + c[None, :] * stride_cc
        for j in tl.static_range(KERNEL - 1):
            tau = t - (KERNEL - 1) + j
            sv = tl.load(
                state + (KERNEL - 1 + tau)[:, None], mask=(rows & (tau < 0))[:, None] & okc[None, :], other=0.0
            )
            w = tl.load(w_ptr + c * stride_wc + j, mask=okc, other=0.0).to(tl.float32)
            acc += sv.to(w_ty).to(tl.float32) * w[None, :]
    out_ty = out_ptr.dtype.element_ty
    y = acc.to(w_ty).to(tl.float32)
    y = (y / (1.0 + tl.exp(-y))).to(w_ty)
    tl.store(out_ptr + (first + t)[:, None] * C + c[None, :], y.to(out_ty), mask=rows[:, None] & okc[None, :])


@triton.jit
def _conv_state_kernel(
    x_ptr,
    conv_ptr,
    slot_ptr,
    start_ptr,
    w_ptr,
    C,
    stride_x,
    stride_cs,
    stride_cc,
    KERNEL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0)
    first = tl.load(start_ptr + r).to(tl.int64)
    length = tl.load(start_ptr + r + 1).to(tl.int64) - first
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    taps = tl.arange(0, BLOCK_K)[None, :]
    keep = (c < C)[:, None] & (taps < KERNEL - 1)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    tau = length - (KERNEL - 1) + taps  # the input the new state's tap holds: < 0 is the old state's
    state = conv_ptr + slot * stride_cs + c[:, None] * stride_cc
    xv = tl.load(x_ptr + (first + tau) * stride_x + c[:, None], mask=keep & (tau >= 0), other=0.0)
    sv = tl.load(state + (KERNEL - 1 + tau), mask=keep & (tau < 0), other=0.0)
    w_ty = w_ptr.dtype.element_ty  # the twin's window is in the weight's dtype
    new = tl.where(tau >= 0, xv.to(w_ty), sv.to(w_ty)).to(conv_ptr.dtype.element_ty)
    tl.debug_barrier()  # every load of this program's state is performed before any store to it
    tl.store(state + taps, new, mask=keep)
