"""Copy missed experts host bank -> device slot with the GPU's own cores, for a miss list held on the device.

A cudaMemcpy needs its addresses and size on the host, so a copy-engine copy of a miss first
needs the miss on the host: one synchronisation per MoE layer, and no CUDA graph. Here the
GPU reads the pinned host banks itself, through the address the driver maps them at (they are
page-locked with cudaHostRegisterMapped): the kernel reads the layer's miss list and its count
from device memory, so its launch (fixed grid, fixed arguments) can be captured in a graph and
replayed whatever the step missed.

`misses` is int32 [max_misses, 2] of (expert, slot) rows, `count` int32 [1]; rows past `count`
are never read. Both weight families of an expert (w13 [2I, H] and w2 [H, I], contiguous rows of
their bank and slot tensors) are copied, viewed as 32-bit words so each thread moves 16-byte
vectors: each row whole, or its first `used_bytes` (a layer whose experts fill a prefix of rows sized
for a larger layer's, a GGUF mix's: the rest would cross PCIe for nothing). The grid is `programs`
persistent programs striding over every (miss, chunk): fewer programs leave more multiprocessors to
the expert GEMMs that run beside the copy, and PCIe, not the number of programs, bounds the
bandwidth once enough bytes are in flight.

Twin: `copy_experts_reference` (plain tensor copies, any device, host-side count)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

COPY_BLOCK = 4096  # 32-bit words per program per iteration: 16 KiB in flight per program
COPY_PROGRAMS = 32


@triton.jit
def _copy_experts_kernel(
    src13_ptr,
    src2_ptr,
    dst13_ptr,
    dst2_ptr,
    misses_ptr,
    count_ptr,
    W13: tl.constexpr,
    W2: tl.constexpr,
    USED13: tl.constexpr,
    USED2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """W13, W2: the rows' words (their strides); USED13, USED2: the words copied of each."""
    count = tl.load(count_ptr)
    chunks13: tl.constexpr = (USED13 + BLOCK - 1) // BLOCK
    chunks2: tl.constexpr = (USED2 + BLOCK - 1) // BLOCK
    per_expert: tl.constexpr = chunks13 + chunks2
    offs = tl.arange(0, BLOCK)
    for c in range(tl.program_id(0), count * per_expert, tl.num_programs(0)):
        i = c // per_expert
        part = c - i * per_expert
        expert = tl.load(misses_ptr + 2 * i).to(tl.int64)
        slot = tl.load(misses_ptr + 2 * i + 1).to(tl.int64)
        if part < chunks13:
            start = part * BLOCK + offs
            ok = start < USED13
            v = tl.load(src13_ptr + expert * W13 + start, mask=ok)
            tl.store(dst13_ptr + slot * W13 + start, v, mask=ok)
        else:
            start = (part - chunks13) * BLOCK + offs
            ok = start < USED2
            v = tl.load(src2_ptr + expert * W2 + start, mask=ok)
            tl.store(dst2_ptr + slot * W2 + start, v, mask=ok)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous [rows, ...] tensor as 32-bit words per row: [rows, row_bytes / 4]."""
    flat = t.reshape(t.shape[0], -1)
    if not t.is_contiguous() or flat.shape[1] * t.element_size() % 4:
        raise ValueError("expert rows must be contiguous and a whole number of 32-bit words")
    return flat.view(torch.int32)


def copy_experts_triton(
    bank13: torch.Tensor,
    bank2: torch.Tensor,
    slots13: torch.Tensor,
    slots2: torch.Tensor,
    misses: torch.Tensor,
    count: torch.Tensor,
    programs: int = COPY_PROGRAMS,
    block: int = COPY_BLOCK,
    used_bytes: tuple[int, int] | None = None,
) -> None:
    """slots13[s] = bank13[e] and slots2[s] = bank2[e] for the first count[0] (e, s) rows of `misses`.

    bank13/bank2: one layer's host bank [E, 2I, H] / [E, H, I] (pinned and mapped on CUDA);
    slots13/slots2: the slot pool [S, 2I, H] / [S, H, I]; misses int32 [M, 2]; count int32 [1];
    `used_bytes`: copy only each w13 and w2 row's first bytes (rounded up to whole words), not the whole rows."""
    if misses.dtype != torch.int32 or misses.dim() != 2 or misses.shape[1] != 2 or not misses.is_contiguous():
        raise ValueError("misses must be a contiguous int32 [max_misses, 2] tensor of (expert, slot)")
    if count.dtype != torch.int32 or count.numel() != 1:
        raise ValueError("count must be an int32 tensor of one element")
    src13, src2, dst13, dst2 = (_words(t) for t in (bank13, bank2, slots13, slots2))
    if src13.shape[1] != dst13.shape[1] or src2.shape[1] != dst2.shape[1]:
        raise ValueError(
            f"bank rows ({src13.shape[1]}, {src2.shape[1]} words) differ from slot rows "
            f"({dst13.shape[1]}, {dst2.shape[1]})"
        )
    w13, w2 = src13.shape[1], src2.shape[1]
    used13, used2 = (w13, w2) if used_bytes is None else (-(-b // 4) for b in used_bytes)
    if not (0 < used13 <= w13 and 0 < used2 <= w2):
        raise ValueError(f"used_bytes {used_bytes} must be within the rows ({4 * w13}, {4 * w2} bytes)")
    _copy_experts_kernel[(programs,)](
        src13, src2, dst13, dst2, misses, count, W13=w13, W2=w2, USED13=used13, USED2=used2, BLOCK=block, num_warps=8
    )


def copy_experts_reference(
    bank13: torch.Tensor,
    bank2: torch.Tensor,
    slots13: torch.Tensor,
    slots2: torch.Tensor,
    misses: torch.Tensor,
    count: torch.Tensor,
    used_bytes: tuple[int, int] | None = None,
) -> None:
    n = int(count.reshape(-1)[0])
    for expert, slot in misses[:n].tolist():
        for bank, slots, used in zip((bank13, bank2), (slots13, slots2), used_bytes or (None, None)):
            words = -(-used // 4) if used is not None else None
            _words(slots[slot : slot + 1])[:, :words].copy_(_words(bank[expert : expert + 1])[:, :words])
