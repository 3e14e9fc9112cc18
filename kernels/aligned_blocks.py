"""The blocks the grouped expert GEMMs launch over (grouped_expert_gemm.py and its quantized twin,
quantized_expert_gemm.py): pairs aligned by slot (kernels/align_pairs.py) fall into blocks of BLOCK_M
rows of one slot each, and a program computes one block. Here: the block size of a step, which blocks a
launch covers (all, or a slot window's), what the two launches of a grouped step share
(`grouped_launch`), and the jit helpers a kernel reads its block with."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.align_pairs import align_pairs_by_slot

# The Triton interpreter (TRITON_INTERPRET=1, CPU tests) computes bf16 dots wrongly: upcast there.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


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


@dataclass(frozen=True)
class GroupedLaunch:
    """What a grouped expert GEMM's gate/up and down launches share, whatever the slots' format: the aligned
    blocks (`aligned_args`: sorted pairs, each block's slot, and the window's block starts, or the block slots
    where the launch is not WINDOWED and does not read them), `grid_m` programs along them, the activation
    scratch [aligned rows, I] between the two launches, the router weights in float32, the slot window, and
    the launches' shared meta-parameters (the caller adds its BLOCK_N and BLOCK_K)."""

    aligned_args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    grid_m: int
    num_pairs: int
    top_k: int
    act: torch.Tensor
    weights: torch.Tensor
    window: tuple[int, int, int]
    meta: dict


def grouped_launch(
    x: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    num_slots: int,
    inter: int,
    aligned: tuple[torch.Tensor, ...] | None,
    max_distinct_slots: int | None,
    slot_window: tuple[int, int, int],
) -> GroupedLaunch | None:
    """The launch of a grouped step over `num_slots` slots of intermediate size `inter` (the arguments of
    `grouped_expert_rows_triton`); None when it has no block to compute."""
    top_k = topk_weights.shape[1]
    num_pairs = x.shape[0] * top_k
    block_m = block_m_for(num_pairs)
    if aligned is None:
        aligned = align_pairs_by_slot(topk_slots, num_slots, block_m, max_distinct_slots)
    sorted_pairs, block_slot, block_start, grid_m = launch_blocks(aligned, num_pairs, block_m, slot_window)
    if num_pairs == 0 or block_slot.numel() == 0:
        return None
    act = torch.empty(sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    meta = dict(
        BLOCK_M=block_m,
        UPCAST=_INTERPRETING or x.dtype == torch.float32,
        PRECISION="ieee" if x.dtype == torch.float32 else None,  # fp32 in, fp32 accuracy out (no TF32)
        WINDOWED=block_start is not None,
    )
    starts = block_start if block_start is not None else block_slot  # not read unless WINDOWED
    return GroupedLaunch((sorted_pairs, block_slot, starts), grid_m, num_pairs, top_k, act, weights, slot_window, meta)
