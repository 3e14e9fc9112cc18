"""The blocks the grouped expert GEMMs launch over (grouped_expert_gemm.py and its quantized twin,
quantized_expert_gemm.py): pairs aligned by slot (kernels/align_pairs.py) fall into blocks of BLOCK_M
rows of one slot each, and a program computes one block. Here: the block size of a step, which blocks a
launch covers (all, or a slot window's), and the jit helpers a kernel reads its block with."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def block_rows(sorted_pairs_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """The BLOCK_M rows of aligned block `pid_m` (all of one slot): their places in the aligned order,
    their (token * k + j) pairs, and which rows are real (padding rows hold the sentinel num_pairs)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
    return offs_m, pair, pair < num_pairs


@triton.jit
def window_blocks(block_start_ptr, slot_lo, slot_hi):
    """[first, last) aligned blocks of the window's slots (block_start: each slot's first block, ascending)."""
    return tl.load(block_start_ptr + slot_lo), tl.load(block_start_ptr + slot_hi)


SMALL_BLOCK_MAX_PAIRS = 1024  # steps of up to this many (token, k) pairs take the small block


def block_m_for(num_pairs: int) -> int:
    """Rows per program: small for decode (few tokens per expert), larger for prefill."""
    return 16 if num_pairs <= SMALL_BLOCK_MAX_PAIRS else 64


SLOT_WINDOW_ALL = (0, 2**31 - 1, 0)  # a launch's (lo, hi, shift) slot window that takes every block


def window_programs(num_pairs: int, num_positions: int, window: int, block_m: int, num_blocks: int) -> int:
    """Programs along the blocks for a windowed launch (a streamed chunk of `window` of the layer's
    `num_positions` staged experts): the window's blocks were the pairs spread evenly over the
    positions, each position's share padded to whole blocks, at most the layer's `num_blocks`. An
    over-estimate where the layer's pairs also go to cached experts; a window with more blocks (a skewed
    routing) loops over them in the same programs."""
    per_position = triton.cdiv(num_pairs, max(1, num_positions))
    return max(1, min(num_blocks, window * triton.cdiv(per_position, block_m)))


def launch_blocks(
    aligned: tuple[torch.Tensor, ...], num_pairs: int, block_m: int, slot_window: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(sorted_pairs, block_slot, block_start or None, programs along the blocks) for a launch over
    `aligned`: one program a block, or, for a window with its block starts given, `window_programs`
    looping over the window's blocks (block_start None: every block is launched and checks its slot)."""
    sorted_pairs, block_slot, *rest = aligned
    num_blocks = block_slot.numel()
    if not rest or slot_window == SLOT_WINDOW_ALL:
        return sorted_pairs, block_slot, None, num_blocks
    (block_start,) = rest
    lo, hi, _ = slot_window
    if not 0 <= lo <= hi < block_start.numel():
        raise ValueError(f"slot window [{lo}, {hi}) outside the {block_start.numel() - 1} aligned slots")
    return (
        sorted_pairs,
        block_slot,
        block_start,
        window_programs(num_pairs, block_start.numel() - 1, hi - lo, block_m, num_blocks),
    )
