"""A decode layer's hand-off to the host moved by the GPU's own cores through mapped pinned memory
(services/worker/offload/host_compute/decode_share.py).

The host's share of a layer needs its pair list and input rows in pinned memory before the host can start,
and the host's float32 sum back in the layer's rows before they are summed. Copy-engine copies did both
(two copies to the host, one back), and beside a full link they were most of the hand-off: a
layer's round trip with those copies took 256-367 µs while the GPU unpacked the next layer's prefetched
experts from the pinned banks, against 38-45 µs on an idle link, and 16-26 µs for the host node alone beside
the same load. The host's share is the critical
path of each layer of the hybrid cut, so that wait was the step's.

Here two small kernels do the same moves with loads and stores to the pinned buffers' mapped addresses
(the banks' own path: kernels/expert_copy.py):

* `stage_for_host`: the pair block and the first `t` input rows, device -> pinned, in one launch;
* `fold_host_sum`: in the layer's rows [T, k, H], the host pairs' rows zeroed and the host's sum [T, H]
  read from pinned memory and added into each token's first row, in one launch that replaces the copy back,
  a masked fill and an add.

With these the round beside the same load took 153 µs: still far from idle (the copy engine's copy out alone
waited 160 µs there, and what the mapped moves still wait for these runs do not say), but less than half.

The same bits as before: the fold adds one float32 value to each first row exactly as `rows[:, 0] +=`
did, after the zeroing. Twins: `stage_for_host_reference`, `fold_host_sum_reference` (torch, any device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import use_triton

STAGE_BLOCK = 1024  # 32-bit words a program moves per iteration
STAGE_PROGRAMS = 8  # a decode step stages a few KB: a few programs write them at the link's rate
FOLD_BLOCK_H = 1024


@triton.jit
def _stage_kernel(block_src, block_dst, n_block, x_src, x_dst, n_x, BLOCK: tl.constexpr):
    first = tl.program_id(0) * BLOCK
    step = tl.num_programs(0) * BLOCK
    for start in range(first, n_block, step):
        o = start + tl.arange(0, BLOCK)
        tl.store(block_dst + o, tl.load(block_src + o, mask=o < n_block), mask=o < n_block)
    for start in range(first, n_x, step):
        o = start + tl.arange(0, BLOCK)
        tl.store(x_dst + o, tl.load(x_src + o, mask=o < n_x), mask=o < n_x)


@triton.jit
def _fold_kernel(rows_ptr, host_pairs_ptr, sum_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = h < H
    total = tl.load(sum_ptr + t * H + h, mask=inside, other=0.0)
    first = rows_ptr + t * K * H + h
    row = tl.load(first, mask=inside, other=0.0).to(tl.float32)
    row = tl.where(tl.load(host_pairs_ptr + t * K) != 0, 0.0, row) + total
    tl.store(first, row.to(rows_ptr.dtype.element_ty), mask=inside)
    for j in tl.static_range(1, K):
        flagged = (tl.load(host_pairs_ptr + t * K + j) + tl.zeros([BLOCK_H], tl.int32)) != 0  # a vector mask
        zeros = tl.zeros([BLOCK_H], dtype=rows_ptr.dtype.element_ty)
        tl.store(rows_ptr + (t * K + j) * H + h, zeros, mask=inside & flagged)


def _words(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous() or t.numel() * t.element_size() % 4:
        raise ValueError("staged buffers must be contiguous and a whole number of 32-bit words")
    return t.reshape(-1).view(torch.int32)


def stage_for_host(block: torch.Tensor, block_host: torch.Tensor, x: torch.Tensor, x_host: torch.Tensor) -> None:
    """block_host[:] = block and x_host[:len(x)] = x: the hand-off's pair block (bytes, device) and the layer's
    input rows [t, H] (device) into their pinned, mapped buffers, on the current stream."""
    if x.shape[1] * x.element_size() % 4 or block.numel() * block.element_size() % 4:
        raise ValueError(
            f"staging moves 32-bit words: a row of {x.shape[1]} x {x.element_size()} bytes and a block "
            f"of {block.numel() * block.element_size()} bytes must be multiples of 4"
        )
    if block_host.dtype != block.dtype or x_host.dtype != x.dtype:
        raise ValueError(f"staging {block.dtype} and {x.dtype} into {block_host.dtype} and {x_host.dtype} buffers")
    if block_host.shape != block.shape or x_host.shape[1:] != x.shape[1:] or x_host.shape[0] < x.shape[0]:
        raise ValueError(
            f"staging {tuple(block.shape)} and {tuple(x.shape)} into buffers of "
            f"{tuple(block_host.shape)} and {tuple(x_host.shape)}"
        )
    (stage_for_host_triton if use_triton(x) else stage_for_host_reference)(block, block_host, x, x_host)


def stage_for_host_triton(block, block_host, x, x_host) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch (buffers checked by `stage_for_host`); returns the two destinations."""
    b_src, b_dst, x_src, x_dst = _words(block), _words(block_host), _words(x), _words(x_host[: x.shape[0]])
    _stage_kernel[(STAGE_PROGRAMS,)](b_src, b_dst, b_src.numel(), x_src, x_dst, x_src.numel(), BLOCK=STAGE_BLOCK)
    return block_host, x_host


def stage_for_host_reference(block, block_host, x, x_host) -> tuple[torch.Tensor, torch.Tensor]:
    block_host.copy_(block)
    x_host[: x.shape[0]].copy_(x)
    return block_host, x_host


def fold_host_sum(rows: torch.Tensor, host_pairs: torch.Tensor, host_sum: torch.Tensor) -> None:
    """rows [T, k, H]: the rows of pairs flagged in `host_pairs` (int8, T * k or more) zeroed, then
    host_sum[:T] (float32 [>= T, H], pinned and mapped on CUDA) added to each token's first row."""
    t, k, hidden = rows.shape
    if not rows.is_contiguous() or host_sum.shape[0] < t or host_sum.shape[1] != hidden or host_pairs.numel() < t * k:
        raise ValueError(
            f"folding a host sum {tuple(host_sum.shape)} with {host_pairs.numel()} flags into rows "
            f"{tuple(rows.shape)} (contiguous: {rows.is_contiguous()})"
        )
    if host_sum.dtype != torch.float32 or not host_sum.is_contiguous():
        raise ValueError("the host's sum must be contiguous float32")
    if host_pairs.dtype != torch.int8:  # the kernel reads a byte a pair
        raise ValueError(f"the host pairs' flags must be int8, not {host_pairs.dtype}")
    (fold_host_sum_triton if use_triton(rows) else fold_host_sum_reference)(rows, host_pairs, host_sum)


def fold_host_sum_triton(rows, host_pairs, host_sum) -> torch.Tensor:
    """The kernel's launch (arguments checked by `fold_host_sum`); returns the rows."""
    t, k, hidden = rows.shape
    _fold_kernel[(t, triton.cdiv(hidden, FOLD_BLOCK_H))](rows, host_pairs, host_sum, hidden, K=k, BLOCK_H=FOLD_BLOCK_H)
    return rows


def fold_host_sum_reference(rows, host_pairs, host_sum) -> torch.Tensor:
    t, k = rows.shape[:2]
    rows.masked_fill_(host_pairs[: t * k].view(t, k, 1).to(rows.device).bool(), 0.0)
    rows[:, 0].add_(host_sum[:t].to(rows.device))
    return rows
