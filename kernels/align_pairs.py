"""Pairs aligned by slot in four Triton launches, and `align_pairs_by_slot`, which dispatches (CUDA -> these,
anything else -> the twin); twin: `align_pairs_by_slot_reference` (kernels/align_pairs_reference.py), the same
layout, bit for bit, from ~35 torch calls. `align_pairs_by_slot_host`: the same layout in numpy.
 Why: a streamed prefill step aligns its pairs twice a MoE layer (the cache's hits, then the staged experts), and
such a step is bound by the host's launches, not the device: each torch call costs the host tens of
microseconds while its kernel takes a few. Here the host pays four launches.

The layout (`align_pairs_by_slot`'s contract): `sorted_pairs` lists each slot's pairs in ascending pair
order, slot by slot, each slot's run padded to a multiple of `block_m` with the sentinel n (so is every
entry past the last run); `block_slot` gives each block of `block_m` entries its slot, -1 past the real
blocks; `block_start[s]` is slot s's first block, `block_start[S]` the number of real blocks. Pairs of
slot -1 are left out.

1. `_count_kernel`, one program a tile of pairs: the tile's count of each slot (a row of `hist`,
   [programs, S + 1], the last column the skipped pairs), and its share of the sentinel fill.
2. `_column_kernel`, one program a group of slots: each slot's total, its blocks into `block_start`
   (to be summed), and the column rewritten in place as the pairs of that slot in the tiles before.
3. `_prefix_kernel`, one program: the blocks summed into each slot's first block (`block_start`).
4. `_scatter_kernel`, one program a tile again: each pair's place, its slot's first entry plus the pairs
   of that slot in the tiles before plus those before it in its own tile (ranked SUB at a time by
   comparison, so the order is the stable one the reference sorts into), and the program's share of
   `block_slot` (each block's slot by bisection over the slots' block ends).
Each is a plain function of its inputs: no atomics race on what they produce (the counts' atomics add
ones), so two runs give the same bits, as the reference's stable sort does."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ferry.kernels.align_pairs_reference import align_pairs_by_slot_reference, max_aligned_blocks
from ferry.kernels.dispatch import use_triton

BINS = 256  # slots a program of the column and prefix kernels takes at a time
SUB = 64  # pairs the scatter ranks together (a SUB x SUB comparison)
CHUNK = 1024  # pairs the count kernel takes at a time, and the smallest tile
MAX_TILES = 64  # tiles (programs of the count and scatter kernels) before a tile grows past CHUNK


@triton.jit(do_not_specialize=["n", "num_slots", "tile", "fill_len", "fill_share"])
def _count_kernel(
    slots_ptr, hist_ptr, sorted_ptr, n, num_slots, tile, fill_len, fill_share, CHUNK: tl.constexpr, BINS: tl.constexpr
):
    p = tl.program_id(0)
    row = hist_ptr + p * (num_slots + 1)
    bins = tl.arange(0, BINS)
    for b0 in range(0, num_slots + 1, BINS):
        tl.store(row + b0 + bins, tl.zeros([BINS], tl.int32), mask=b0 + bins < num_slots + 1)
    lane = tl.arange(0, CHUNK)
    sentinel = tl.zeros([CHUNK], tl.int32) + n
    for f0 in range(0, fill_share, CHUNK):
        f = p * fill_share + f0 + lane
        tl.store(sorted_ptr + f, sentinel, mask=(f0 + lane < fill_share) & (f < fill_len))
    tl.debug_barrier()  # the row is zero before any thread counts into it
    ones = tl.full([CHUNK], 1, tl.int32)
    for c0 in range(0, tile, CHUNK):
        i = p * tile + c0 + lane
        m = (c0 + lane < tile) & (i < n)
        s = tl.load(slots_ptr + i, mask=m, other=-1).to(tl.int32)
        # a slot past num_slots is left out like -1 (the twin's scatter would refuse it), never written past the row
        tl.atomic_add(row + tl.where((s >= 0) & (s < num_slots), s, num_slots), ones, mask=m, sem="relaxed")


@triton.jit(do_not_specialize=["num_tiles", "num_slots", "block_m"])
def _column_kernel(hist_ptr, block_start_ptr, num_tiles, num_slots, block_m, BINS: tl.constexpr):
    b = tl.program_id(0) * BINS + tl.arange(0, BINS)
    m = b < num_slots
    stride = num_slots + 1
    before = tl.zeros([BINS], tl.int32)
    for p in range(0, num_tiles):
        ptr = hist_ptr + p * stride + b
        count = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, before, mask=m)  # the slot's pairs in the tiles before this one
        before += count
    tl.store(block_start_ptr + b, (before + block_m - 1) // block_m, mask=m)  # the slot's blocks, summed next


@triton.jit(do_not_specialize=["num_slots"])
def _prefix_kernel(block_start_ptr, num_slots, BINS: tl.constexpr):
    bins = tl.arange(0, BINS)
    carry = tl.sum(tl.zeros([BINS], tl.int32), axis=0)
    for b0 in range(0, num_slots, BINS):
        m = b0 + bins < num_slots
        blocks = tl.load(block_start_ptr + b0 + bins, mask=m, other=0)
        tl.store(block_start_ptr + b0 + bins, carry + tl.cumsum(blocks, axis=0) - blocks, mask=m)
        carry += tl.sum(blocks, axis=0)
    tl.store(block_start_ptr + num_slots, carry)


@triton.jit(
    do_not_specialize=["n", "num_slots", "tile", "block_m", "num_blocks", "block_share", "search_steps", "fill_len"]
)
def _scatter_kernel(
    slots_ptr,
    hist_ptr,
    block_start_ptr,
    sorted_ptr,
    block_slot_ptr,
    n,
    num_slots,
    tile,
    block_m,
    num_blocks,
    block_share,
    search_steps,
    fill_len,
    SUB: tl.constexpr,
):
    p = tl.program_id(0)
    row = hist_ptr + p * (num_slots + 1)
    lane = tl.arange(0, SUB)
    earlier = lane[None, :] < lane[:, None]  # [i, j]: pair j comes before pair i
    later = lane[None, :] > lane[:, None]
    # the tile's own pairs only: past n (the last tile's end, and all of a tile of a small step) nothing is kept
    for s0 in range(0, tl.minimum(tile, n - p * tile), SUB):
        i = p * tile + s0 + lane
        s = tl.load(slots_ptr + i, mask=(s0 + lane < tile) & (i < n), other=-1).to(tl.int32)
        kept = (s0 + lane < tile) & (i < n) & (s >= 0) & (s < num_slots)
        key = tl.where(kept, s, -1 - lane)  # a left-out pair matches no other
        same = key[:, None] == key[None, :]
        rank = tl.sum((same & earlier).to(tl.int32), axis=1)
        last = tl.sum((same & later).to(tl.int32), axis=1) == 0
        before = tl.load(row + s, mask=kept, other=0)
        first = tl.load(block_start_ptr + s, mask=kept, other=0) * block_m
        place = first + before + rank
        tl.store(sorted_ptr + place, i, mask=kept & (place < fill_len))  # a bound set too low loses pairs, not memory
        tl.debug_barrier()  # every pair read the count before the last of its slot moves it on
        tl.store(row + s, before + rank + 1, mask=kept & last)
        tl.debug_barrier()
    blocks = tl.arange(0, SUB)
    for k0 in range(0, block_share, SUB):
        k = p * block_share + k0 + blocks
        lo = tl.zeros([SUB], tl.int32)
        hi = lo + num_slots
        for _ in range(0, search_steps):  # the first slot whose blocks end past k
            active = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(block_start_ptr + mid + 1, mask=active, other=0)
            past = end > k
            hi = tl.where(active & past, mid, hi)
            lo = tl.where(active & ~past, mid + 1, lo)
        tl.store(
            block_slot_ptr + k, tl.where(lo < num_slots, lo, -1), mask=(k0 + blocks < block_share) & (k < num_blocks)
        )


def align_pairs_by_slot_triton(
    topk_slots: torch.Tensor, num_slots: int, block_m: int, max_blocks: int, num_warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_blocks * block_m], block_slot [max_blocks], block_start [num_slots + 1]), int32,
    for the pairs of `topk_slots` (any integer dtype; -1: left out) over `num_slots` slots; `max_blocks` is
    the caller's bound on the real blocks (`align_pairs_by_slot`'s worst case). A slot past num_slots is left
    out like -1, and pairs past a bound set too low are lost, not written out of bounds. No host sync."""
    flat = topk_slots.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n, device = flat.numel(), flat.device
    if max(n, max_blocks * block_m) >= 2**30:  # with room for a tile's indices past the last pair
        raise ValueError(f"{n} pairs exceed the alignment's int32 indices")
    tile = max(CHUNK, triton.cdiv(triton.cdiv(max(n, 1), MAX_TILES), CHUNK) * CHUNK)
    tiles = max(1, triton.cdiv(n, tile))
    hist = torch.empty(tiles * (num_slots + 1), dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_slot = torch.empty(max_blocks, dtype=torch.int32, device=device)
    block_start = torch.empty(num_slots + 1, dtype=torch.int32, device=device)
    fill = sorted_pairs.numel()
    _count_kernel[(tiles,)](
        flat,
        hist,
        sorted_pairs,
        n,
        num_slots,
        tile,
        fill,
        triton.cdiv(fill, tiles),
        CHUNK=CHUNK,
        BINS=BINS,
        num_warps=num_warps,
    )
    _column_kernel[(triton.cdiv(num_slots, BINS),)](
        hist, block_start, tiles, num_slots, block_m, BINS=BINS, num_warps=num_warps
    )
    _prefix_kernel[(1,)](block_start, num_slots, BINS=BINS, num_warps=num_warps)
    _scatter_kernel[(tiles,)](
        flat,
        hist,
        block_start,
        sorted_pairs,
        block_slot,
        n,
        num_slots,
        tile,
        block_m,
        max_blocks,
        triton.cdiv(max_blocks, tiles),
        num_slots.bit_length(),
        fill,
        SUB=SUB,
        num_warps=num_warps,
    )
    return sorted_pairs, block_slot, block_start


def align_pairs_by_slot(
    topk_slots: torch.Tensor,
    num_slots: int,
    block_m: int,
    max_distinct_slots: int | None = None,
    block_starts: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(sorted_pairs, block_slot): flat (token*k + j) pair indices grouped by slot, each slot's
    group padded to a multiple of block_m with the sentinel T*k, and the slot of each block of
    block_m rows (-1 for blocks past the end). Pairs with slot -1 are left out. No host sync.

    The grid is sized for the worst case; `max_distinct_slots` (e.g. one layer's expert count,
    known to the caller) tightens it, and with it the intermediate buffer, for large steps.
    `block_starts`: a third tensor, int32 [num_slots + 1], slot s's first block (its blocks are
    [block_start[s], block_start[s + 1])), for a caller that computes a window of slots at a time
    (`grouped_expert_rows_triton`'s slot_window).

    CUDA takes four Triton launches (above), anything else this function's torch twin,
    `align_pairs_by_slot_reference`: the same bits."""
    n = topk_slots.numel()
    if use_triton(topk_slots) and n and num_slots >= 1:
        aligned = align_pairs_by_slot_triton(
            topk_slots, num_slots, block_m, max_aligned_blocks(n, num_slots, block_m, max_distinct_slots)
        )
        return aligned if block_starts else aligned[:2]
    return align_pairs_by_slot_reference(topk_slots, num_slots, block_m, max_distinct_slots, block_starts)


def align_pairs_by_slot_host(topk_slots: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """`align_pairs_by_slot` on the host (numpy), without the worst-case tail: exactly the real
    blocks. int32 arrays, same layout and sentinel."""
    flat = np.asarray(topk_slots, dtype=np.int64).reshape(-1)
    n = flat.size
    kept = np.flatnonzero(flat >= 0)
    order = kept[np.argsort(flat[kept], kind="stable")]
    slots, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    blocks = (counts + block_m - 1) // block_m
    padded_start = (np.cumsum(blocks) - blocks) * block_m
    sorted_pairs = np.full(int(blocks.sum()) * block_m, n, dtype=np.int32)
    sorted_pairs[np.repeat(padded_start - starts, counts) + np.arange(order.size)] = order
    return sorted_pairs, np.repeat(slots, blocks).astype(np.int32)
