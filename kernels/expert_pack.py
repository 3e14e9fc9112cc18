"""Experts packed to 12 bits a value, losslessly, so that a quarter fewer bytes cross PCIe.

A bf16 value is sign (1 bit), exponent (8) and mantissa (7). Trained weights, and the benchmarks'
normal dummy weights, use few exponents: nearly every value of an expert's weight matrix lies
within 15 binades below the matrix's largest. So an expert keeps, per value:

* `lo`: one byte, the sign and the 7 mantissa bits;
* `hi`: four bits, the exponent as a code 1..15 above its family's `base` (two codes a byte, the
  even value in the low nibble); code 0 is a zero of the byte's sign, or an *escape*: a value
  outside the window (a subnormal, a tiny value, inf or NaN), whose 16 bits are kept whole in the
  expert's escape list (`esc_index` into the expert's values, `esc_bits`; the expert's range is
  `esc_offsets[e:e+2]`). An escape's `lo` is 0x01 (a zero's mantissa is 0), so the unpacking
  writes every value but the escapes, and writes those from the list: no write overlaps another,
  so one kernel does both, in any order.

An expert is one row of V = V13 + V2 values: its w13 [2I, H] then its w2 [H, I], flattened, each
family with its own base (a down projection's values are smaller than a gate's). 12 bits a value
instead of 16, plus six bytes per escape: a quarter fewer bytes on the wire.

`unpack_experts_triton` restores the bits on the GPU while copying: like kernels/expert_copy.py it
reads the packed host rows through their mapped address, for an expert list and count that may
live on the device (graph-safe), and writes bf16 rows into device slots, escapes included, in one
launch (a second kernel for the escapes cost a launch and three dependent PCIe round trips per
copy, serial on the copy stream: 24 a decode step).
`unpack_expert_reference` restores one expert on any device (the twin the tests hold it to).

V13 and V2 must be multiples of 4: a program lane unpacks 32-bit words of `lo` (four values) with
their 16 bits of `hi`, and a word never straddles the two families."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WINDOW = 15  # exponent codes 1..15 above the family's base; 0 escapes
# 64 programs of 2,048 words (8 KiB of lo + 4 KiB of hi in
# flight each) unpack 40 experts at 50.1 GB/s of packed bytes, 66.8 GB/s of bf16 delivered; 32 programs
# of 2,048 words 49.8, and every grid of 32-96 programs and 1,024-4,096 words within 2% of that.
UNPACK_BLOCK = 2048
UNPACK_PROGRAMS = 64
ESCAPE_BLOCK = 128
ESCAPE_SPLIT = 4  # programs that share one expert's escapes: a few hundred each for trained weights


def check_packable(v13: int, v2: int) -> None:
    if v13 % 4 or v2 % 4:
        raise ValueError(f"packed experts need weight families of a multiple of 4 values, got {v13} and {v2}")


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pack bf16 experts `w13` [n, 2I, H] and `w2` [n, H, I] on their device: lo uint8 [n, V],
    hi uint8 [n, V // 2], base int32 [n, 2], counts int64 [n] (escapes per expert), esc_index
    int32 [X] and esc_bits int16 [X] (expert by expert, ascending positions)."""
    if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        raise ValueError(f"only bf16 experts are packed, got {w13.dtype} and {w2.dtype}")
    n = w13.shape[0]
    a, b = w13.reshape(n, -1), w2.reshape(n, -1)
    check_packable(a.shape[1], b.shape[1])
    bits = torch.cat([a, b], dim=1).view(torch.int16).to(torch.int32) & 0xFFFF
    exp = (bits >> 7) & 0xFF
    finite_exp = torch.where(exp != 0xFF, exp, 0)
    v13 = a.shape[1]
    top = torch.stack([finite_exp[:, :v13].amax(dim=1), finite_exp[:, v13:].amax(dim=1)], dim=1)
    del finite_exp
    base = (top - WINDOW).clamp(min=0).to(torch.int32)
    below = torch.cat([base[:, :1].expand(n, v13), base[:, 1:].expand(n, b.shape[1])], dim=1)
    code = exp - below
    del below, exp
    inside = (code >= 1) & (code <= WINDOW) & (((bits >> 7) & 0xFF) != 0xFF)
    code = torch.where(inside, code, 0)
    escaped = ~inside & ((bits & 0x7FFF) != 0)  # a zero unpacks as itself: code 0, its sign in lo
    lo = torch.where(escaped, 0x01, ((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    hi = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    del code
    counts = escaped.sum(dim=1)
    where = escaped.nonzero()  # row-major: expert by expert, ascending positions
    esc_index = where[:, 1].to(torch.int32)
    esc_bits = bits[escaped].to(torch.int16)
    return {"lo": lo, "hi": hi, "base": base, "counts": counts, "esc_index": esc_index, "esc_bits": esc_bits}


def unpack_expert_reference(
    lo: torch.Tensor, hi: torch.Tensor, base: torch.Tensor, esc_index: torch.Tensor, esc_bits: torch.Tensor, v13: int
) -> torch.Tensor:
    """One expert's V bf16 values (w13 then w2, flattened) from its packed row, bit for bit."""
    lo32, hi32 = lo.to(torch.int32), hi.to(torch.int32)
    code = torch.stack([hi32 & 0xF, hi32 >> 4], dim=-1).reshape(lo32.shape)
    family_base = torch.full_like(lo32, int(base[0]))
    family_base[v13:] = int(base[1])
    bits = ((lo32 & 0x80) << 8) | ((code + family_base) << 7) | (lo32 & 0x7F)
    bits = torch.where(code == 0, (lo32 & 0x80) << 8, bits)
    bits[esc_index.long()] = esc_bits.to(torch.int32) & 0xFFFF
    return bits.to(torch.int16).view(torch.bfloat16)  # int32 -> int16 keeps the low 16 bits


@triton.jit
def _unpack_words(lo_ptr, hi_ptr, dst_ptr, base, first, n_words, BLOCK: tl.constexpr):
    """Words first..first+BLOCK of one family: lo_ptr (int32) and hi_ptr (int16) at the family's
    start in the expert's packed row, dst_ptr (int16) at the family's start in the slot."""
    w = first + tl.arange(0, BLOCK)
    ok = w < n_words
    lo = tl.load(lo_ptr + w, mask=ok, other=0)
    hi = tl.load(hi_ptr + w, mask=ok, other=0).to(tl.int32)
    j = tl.arange(0, 4)
    byte = (lo[:, None] >> (8 * j)[None, :]) & 0xFF  # little-endian: value 4w + j
    code = (hi[:, None] >> (4 * j)[None, :]) & 0xF
    bits = ((byte & 0x80) << 8) | ((code + base) << 7) | (byte & 0x7F)
    zero = code == 0
    bits = tl.where(zero, (byte & 0x80) << 8, bits)  # a signed zero
    escape = zero & ((byte & 0x7F) != 0)  # written from the escape list, by whichever program has it
    tl.store(dst_ptr + 4 * w[:, None] + j[None, :], bits.to(tl.int16), mask=ok[:, None] & ~escape)


@triton.jit
def _listed(list_ptr, i, slot0, PAIRS: tl.constexpr):
    """The i-th (expert, slot): rows of (expert, slot), or experts into slots slot0, slot0 + 1, ..."""
    if PAIRS:
        expert = tl.load(list_ptr + 2 * i).to(tl.int64)
        slot = tl.load(list_ptr + 2 * i + 1).to(tl.int64)
    else:
        expert = tl.load(list_ptr + i).to(tl.int64)
        slot = (slot0 + i).to(tl.int64)
    return expert, slot


@triton.jit
def _patch_escapes(
    offsets_ptr,
    index_ptr,
    bits_ptr,
    dst13_ptr,
    dst2_ptr,
    expert,
    slot,
    part,
    V13: tl.constexpr,
    V2: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Block `part` of every SPLIT blocks of one expert's escapes, into its slot."""
    start = tl.load(offsets_ptr + expert)
    end = tl.load(offsets_ptr + expert + 1)
    for s in range(start + part * BLOCK, end, SPLIT * BLOCK):
        k = s + tl.arange(0, BLOCK)
        ok = k < end
        where = tl.load(index_ptr + k, mask=ok, other=0).to(tl.int64)
        value = tl.load(bits_ptr + k, mask=ok, other=0)
        tl.store(dst13_ptr + slot * V13 + where, value, mask=ok & (where < V13))
        tl.store(dst2_ptr + slot * V2 + (where - V13), value, mask=ok & (where >= V13))


@triton.jit
def _unpack_experts_kernel(
    lo_ptr,
    hi_ptr,
    base_ptr,
    offsets_ptr,
    index_ptr,
    bits_ptr,
    dst13_ptr,
    dst2_ptr,
    list_ptr,
    count_ptr,
    count_arg,
    slot0,
    W13: tl.constexpr,
    W2: tl.constexpr,
    BLOCK: tl.constexpr,
    ESC_BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    COUNT_ON_DEVICE: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """Every listed expert's row into its slot: the words (lo viewed as int32, hi as int16, one
    halfword of codes per word; the slots as int16; W13/W2 the families' words), then each
    expert's escapes, shared by SPLIT work items."""
    if COUNT_ON_DEVICE:
        count = tl.load(count_ptr)
    else:
        count = count_arg
    chunks13: tl.constexpr = (W13 + BLOCK - 1) // BLOCK
    chunks2: tl.constexpr = (W2 + BLOCK - 1) // BLOCK
    per_expert: tl.constexpr = chunks13 + chunks2
    for c in range(tl.program_id(0), count * per_expert, tl.num_programs(0)):
        i = c // per_expert
        part = c - i * per_expert
        expert, slot = _listed(list_ptr, i, slot0, PAIRS)
        row = expert * (W13 + W2)
        if part < chunks13:
            base = tl.load(base_ptr + 2 * expert)
            _unpack_words(lo_ptr + row, hi_ptr + row, dst13_ptr + slot * (4 * W13), base, part * BLOCK, W13, BLOCK)
        else:
            base = tl.load(base_ptr + 2 * expert + 1)
            _unpack_words(
                lo_ptr + row + W13,
                hi_ptr + row + W13,
                dst2_ptr + slot * (4 * W2),
                base,
                (part - chunks13) * BLOCK,
                W2,
                BLOCK,
            )
    for c in range(tl.program_id(0), count * SPLIT, tl.num_programs(0)):
        i = c // SPLIT
        expert, slot = _listed(list_ptr, i, slot0, PAIRS)
        _patch_escapes(
            offsets_ptr,
            index_ptr,
            bits_ptr,
            dst13_ptr,
            dst2_ptr,
            expert,
            slot,
            c - i * SPLIT,
            4 * W13,
            4 * W2,
            ESC_BLOCK,
            SPLIT,
        )


def unpack_experts_triton(
    lo: torch.Tensor,
    hi: torch.Tensor,
    base: torch.Tensor,
    esc_offsets: torch.Tensor,
    esc_index: torch.Tensor,
    esc_bits: torch.Tensor,
    dst13: torch.Tensor,
    dst2: torch.Tensor,
    listed: torch.Tensor,
    count: torch.Tensor | int,
    slot0: int | None = None,
    programs: int = UNPACK_PROGRAMS,
    block: int = UNPACK_BLOCK,
    escape_block: int = ESCAPE_BLOCK,
) -> None:
    """dst13[s], dst2[s] = expert e unpacked, for the first `count` listed experts.

    `listed`: int32 [M, 2] rows of (expert, slot) on the device, or, with `slot0`, int32 [M] experts
    going to slots slot0, slot0 + 1, ... `count`: an int32 [1] tensor on the device (no host
    synchronisation: graph-capturable) or an int. The packed layer (lo [E, V], hi [E, V // 2],
    base [E, 2], esc_offsets [E + 1], esc_index, esc_bits) where the GPU reads it (device, or
    pinned and mapped); dst13/dst2 the bf16 slot pool [S, 2I, H] / [S, H, I]."""
    pairs = slot0 is None
    if (
        listed.dtype != torch.int32
        or not listed.is_contiguous()
        or listed.dim() != (2 if pairs else 1)
        or (pairs and listed.shape[1] != 2)
    ):
        raise ValueError("listed must be a contiguous int32 [M, 2] tensor of (expert, slot), or int32 [M] with slot0")
    on_device = isinstance(count, torch.Tensor)
    if on_device and (count.dtype != torch.int32 or count.numel() != 1):
        raise ValueError("count must be an int32 tensor of one element, or an int")
    v13, v2 = dst13[0].numel(), dst2[0].numel()
    if (
        dst13.dtype != torch.bfloat16
        or dst2.dtype != torch.bfloat16
        or not (dst13.is_contiguous() and dst2.is_contiguous())
    ):
        raise ValueError("the slots must be contiguous bf16 tensors")
    if lo.shape[1] != v13 + v2:
        raise ValueError(f"packed rows hold {lo.shape[1]} values, the slots {v13} + {v2}")
    check_packable(v13, v2)
    n = 0 if on_device else int(count)
    if not on_device and n == 0:
        return
    cnt = count if on_device else listed  # an unread placeholder pointer when the count is an int
    s0 = 0 if pairs else int(slot0)
    d13, d2 = dst13.view(torch.int16), dst2.view(torch.int16)
    _unpack_experts_kernel[(programs,)](
        lo.view(torch.int32),
        hi.view(torch.int16),
        base,
        esc_offsets,
        esc_index,
        esc_bits,
        d13,
        d2,
        listed,
        cnt,
        n,
        s0,
        W13=v13 // 4,
        W2=v2 // 4,
        BLOCK=block,
        ESC_BLOCK=escape_block,
        SPLIT=ESCAPE_SPLIT,
        COUNT_ON_DEVICE=on_device,
        PAIRS=pairs,
        num_warps=8,
    )
