"""Reference twin of kernels/align_pairs.py: pairs aligned by slot in torch calls (a stable sort), the
same layout bit for bit (its contract: align_pairs.py's docstring), and the layout's worst case in blocks,
which sizes both."""

from __future__ import annotations

import torch

from ferry.shared.units import ceil_div


def max_aligned_blocks(num_pairs: int, num_slots: int, block_m: int, max_distinct_slots: int | None = None) -> int:
    """The alignment's worst case in blocks: the pairs' own, plus one partial block for every slot that
    may hold some (at most the pairs, the slots and `max_distinct_slots`)."""
    distinct = min(num_pairs, num_slots, max_distinct_slots if max_distinct_slots is not None else num_slots)
    return ceil_div(num_pairs, block_m) + distinct


def align_pairs_by_slot_reference(
    topk_slots: torch.Tensor,
    num_slots: int,
    block_m: int,
    max_distinct_slots: int | None = None,
    block_starts: bool = False,
) -> tuple[torch.Tensor, ...]:
    """`align_pairs_by_slot` in torch calls (a stable sort of the pairs by slot): the twin of
    kernels/align_pairs.py, and what CPU steps take."""
    flat = topk_slots.reshape(-1).to(torch.int64)
    n = flat.numel()
    device = flat.device
    key = torch.where(flat >= 0, flat, num_slots)  # skipped pairs sort last, into bin num_slots
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_slots]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    first = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    kept = sorted_key < num_slots
    slot_of_sorted = sorted_key.clamp(max=num_slots - 1)
    rank = torch.arange(n, device=device) - first[slot_of_sorted]
    max_blocks = max_aligned_blocks(n, num_slots, block_m, max_distinct_slots)
    trash = max_blocks * block_m  # skipped pairs are scattered here and never read
    dest = torch.where(kept, padded_start[slot_of_sorted] + rank, trash)
    sorted_pairs = torch.full((trash + 1,), n, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_rows = torch.arange(max_blocks, device=device) * block_m  # each block's first aligned row
    idx = torch.searchsorted(padded_end, block_rows, right=True)
    block_slot = torch.where(idx < num_slots, idx, -1).to(torch.int32)
    if block_starts:
        starts = torch.cat([padded_start, padded_end[-1:]]) // block_m
        return sorted_pairs[:trash], block_slot, starts.to(torch.int32)
    return sorted_pairs[:trash], block_slot
