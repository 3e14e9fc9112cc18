"""GGUF block types decoded in registers, in Triton: one small function a type, shared by the decode pair GEMV
(gguf_expert_gemv.py) and the prefill grouped GEMM (gguf_expert_gemm.py) through `gguf_weights`, and tiles of 256
inputs for the pair GEMV through `gguf_tile`.

Each decoder takes byte pointers `row` to rows of a type's blocks (the file's bytes unchanged: kernels/gguf_blocks.py
gives every layout), the inputs `col` wanted of them and a mask (masked weights read 0), broadcast against each
other, and returns float32 weights computed as the twin (kernels/gguf_blocks.py) computes them: its products in its
order, so each weight is the twin's bits. `gguf_weights` loads a weight's code and its block's scales per weight
(byte gathers within the rows): correct for every shape, slow where a 256-value block keeps eight scales in packed
bits. `gguf_tile` decodes a row's 256 inputs as [rows, 8, 32] (input 32 s + i), so that the 256-value types
(K-quants, IQ4_XS) load each 32-value sub-block's scale once and their codes as contiguous bytes; the other types
take `gguf_weights` over the same tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ferry.kernels.gguf_blocks import IQ4_GRID, MXFP4_DOUBLED

# ggml type name -> the GGML constexpr `gguf_weights` branches on; the types without one have only the twin and
# are refused on CUDA at boot
GGUF_KERNEL_TYPES = {
    "Q8_0": 0,
    "Q4_K": 1,
    "Q6_K": 2,
    "Q4_0": 3,
    "Q5_K": 4,
    "IQ4_NL": 5,
    "IQ4_XS": 6,
    "MXFP4": 7,
    "Q4_1": 8,
    "Q5_0": 9,
    "Q5_1": 10,
}


def _packed_magnitudes(values) -> int:
    """Eight table entries' magnitudes (each < 128), entry i in byte i of one int64 (an immediate in the kernel,
    not a table in memory)."""
    assert len(values) == 8 and all(abs(v) < 128 for v in values)
    return sum(abs(v) << (8 * i) for i, v in enumerate(values))


# the 16-entry tables as two words of magnitudes, their signs by half: IQ4's grid is negative in its low half,
# MXFP4's doubled e2m1 negative in its high half (the same magnitudes as its low)
assert all(v < 0 for v in IQ4_GRID[:8]) and all(v > 0 for v in IQ4_GRID[8:])
assert MXFP4_DOUBLED[8:] == tuple(-v for v in MXFP4_DOUBLED[:8])
IQ4_LOW: tl.constexpr = tl.constexpr(_packed_magnitudes(IQ4_GRID[:8]))
IQ4_HIGH: tl.constexpr = tl.constexpr(_packed_magnitudes(IQ4_GRID[8:]))
MXFP4_HALF: tl.constexpr = tl.constexpr(_packed_magnitudes(MXFP4_DOUBLED[:8]))


@triton.jit
def _half_at(p, mask):
    """The little-endian float16 at byte pointers p (any alignment), as float32; masked: 0."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte_at(p, mask):
    """The uint8 at byte pointers p, as int32; masked: 0."""
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _table_entry(idx, LOW: tl.constexpr, HIGH: tl.constexpr, LOW_NEGATIVE: tl.constexpr):
    """Entry idx (int32, 0-15) of a 16-entry table of small integers, as float32: its magnitude byte idx % 8 of LOW
    (idx < 8) or HIGH, negative in the low half where LOW_NEGATIVE, else in the high half (a zero stays +0)."""
    low = idx < 8
    magnitude = ((tl.where(low, LOW, HIGH) >> ((idx % 8) * 8).to(tl.int64)) & 255).to(tl.int32)
    if LOW_NEGATIVE:
        negative = low
    else:
        negative = idx >= 8
    return tl.where(negative, -magnitude, magnitude).to(tl.float32)


@triton.jit
def _nibble_of_32(qs, v, mask):
    """Value v (0-31) of a 32-value run of 4-bit codes in 16 bytes at qs: the low nibbles are values 0-15, the
    high 16-31 (Q4_0's order, also Q4_1's, Q5_0's, Q5_1's, IQ4_NL's, IQ4_XS's sub-blocks and MXFP4's)."""
    return (_byte_at(qs + v % 16, mask) >> ((v // 16) * 4)) & 15


@triton.jit
def _bit_of_32(qh, v, mask):
    """Bit v (0-31) of the little-endian uint32 at qh (Q5_0's and Q5_1's fifth bits)."""
    return (_byte_at(qh + v // 8, mask) >> (v % 8)) & 1


@triton.jit
def _k_scale_min(scales, j, mask):
    """Q4_K's and Q5_K's sub-block j (0-7) 6-bit scale and min from the 12 bytes at `scales`, as float32: j < 4
    the low 6 bits of bytes j (scale) and 4 + j (min); j >= 4 the low (scale) and high (min) nibble of byte
    8 + j - 4, their top two bits the top two of bytes j - 4 and 4 + j - 4."""
    a = _byte_at(scales + j % 4, mask)
    b = _byte_at(scales + 4 + j % 4, mask)
    m = _byte_at(scales + 8 + j % 4, mask)
    sc = tl.where(j < 4, a & 63, (m & 15) | ((a >> 6) << 4)).to(tl.float32)
    mn = tl.where(j < 4, b & 63, (m >> 4) | ((b >> 6) << 4)).to(tl.float32)
    return sc, mn


@triton.jit
def _k_nibble(qs, v, mask):
    """Q4_K's and Q5_K's 4-bit code of value v (0-255) in the 128 bytes at qs: nibble (v // 32) % 2 (low first)
    of byte 32 (v // 64) + v % 32."""
    return (_byte_at(qs + (v // 64) * 32 + v % 32, mask) >> (((v // 32) % 2) * 4)) & 15


@triton.jit
def _q8_0(row, col, mask):
    """Q8_0 (32 values, 34 bytes): d q, d the fp16 at 0, q the int8 at 2 + v."""
    blk = row + (col // 32) * 34
    q = tl.load(blk + 2 + col % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return _half_at(blk, mask) * q


@triton.jit
def _q4_0(row, col, mask):
    """Q4_0 (32, 18): d (q - 8), d the fp16 at 0, q value v of the 16 bytes at 2."""
    blk = row + (col // 32) * 18
    q = _nibble_of_32(blk + 2, col % 32, mask).to(tl.float32)
    return _half_at(blk, mask) * (q - 8.0)


@triton.jit
def _q4_1(row, col, mask):
    """Q4_1 (32, 20): d q + m, d and m the fp16s at 0 and 2, q value v of the 16 bytes at 4."""
    blk = row + (col // 32) * 20
    q = _nibble_of_32(blk + 4, col % 32, mask).to(tl.float32)
    return _half_at(blk, mask) * q + _half_at(blk + 2, mask)


@triton.jit
def _q5_0(row, col, mask):
    """Q5_0 (32, 22): d (q - 16), d the fp16 at 0, q's low 4 bits value v of the 16 bytes at 6, its fifth bit v
    of the uint32 at 2."""
    blk = row + (col // 32) * 22
    v = col % 32
    q = (_nibble_of_32(blk + 6, v, mask) | (_bit_of_32(blk + 2, v, mask) << 4)).to(tl.float32)
    return _half_at(blk, mask) * (q - 16.0)


@triton.jit
def _q5_1(row, col, mask):
    """Q5_1 (32, 24): d q + m, d and m the fp16s at 0 and 2, q's low 4 bits value v of the 16 bytes at 8, its
    fifth bit v of the uint32 at 4."""
    blk = row + (col // 32) * 24
    v = col % 32
    q = (_nibble_of_32(blk + 8, v, mask) | (_bit_of_32(blk + 4, v, mask) << 4)).to(tl.float32)
    return _half_at(blk, mask) * q + _half_at(blk + 2, mask)


@triton.jit
def _q4_k(row, col, mask):
    """Q4_K (256, 144): (d sc_j) q - dmin m_j, d and dmin the fp16s at 0 and 2, sub-block j = v // 32 with its
    scale and min from the 12 bytes at 4, q the 4-bit code of v in the 128 bytes at 16."""
    blk = row + (col // 256) * 144
    v = col % 256
    sc, mn = _k_scale_min(blk + 4, v // 32, mask)
    q = _k_nibble(blk + 16, v, mask).to(tl.float32)
    return (_half_at(blk, mask) * sc) * q - _half_at(blk + 2, mask) * mn


@triton.jit
def _q5_k(row, col, mask):
    """Q5_K (256, 176): Q4_K's, its codes' low 4 bits in the 128 bytes at 48 and their fifth bit bit v // 32 of
    byte 16 + v % 32."""
    blk = row + (col // 256) * 176
    v = col % 256
    sc, mn = _k_scale_min(blk + 4, v // 32, mask)
    high = (_byte_at(blk + 16 + v % 32, mask) >> (v // 32)) & 1
    q = (_k_nibble(blk + 48, v, mask) | (high << 4)).to(tl.float32)
    return (_half_at(blk, mask) * sc) * q - _half_at(blk + 2, mask) * mn


@triton.jit
def _q6_k(row, col, mask):
    """Q6_K (256, 210): (d sc) (q - 32), d the fp16 at 208, sc the int8 at 192 + v // 16, q's low 4 bits nibble
    w // 64 of byte 64 h + w % 64 and its high 2 bits pair w // 32 of byte 128 + 32 h + w % 32 (h = v // 128,
    w = v % 128)."""
    blk = row + (col // 256) * 210
    v = col % 256
    h = v // 128
    r = v % 128
    low = (_byte_at(blk + 64 * h + r % 64, mask) >> ((r // 64) * 4)) & 15
    high = (_byte_at(blk + 128 + 32 * h + r % 32, mask) >> ((r // 32) * 2)) & 3
    q = (low | (high << 4)).to(tl.float32) - 32.0
    sc = tl.load(blk + 192 + v // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return (_half_at(blk + 208, mask) * sc) * q


@triton.jit
def _iq4_nl(row, col, mask):
    """IQ4_NL (32, 18): d grid[q], d the fp16 at 0, q value v of the 16 bytes at 2 (an index into IQ4_GRID)."""
    blk = row + (col // 32) * 18
    q = _nibble_of_32(blk + 2, col % 32, mask)
    return _half_at(blk, mask) * _table_entry(q, IQ4_LOW, IQ4_HIGH, True)


@triton.jit
def _iq4_xs(row, col, mask):
    """IQ4_XS (256, 136): (d (sc_j - 32)) grid[q], d the fp16 at 0, sub-block j = v // 32 with its 6-bit scale's
    low 4 bits nibble j % 2 of byte 4 + j // 2 and high 2 bits pair j % 4 of byte 2 + j // 4 (the uint16 at 2),
    q value v % 32 of the 16 bytes at 8 + 16 j."""
    blk = row + (col // 256) * 136
    v = col % 256
    j = v // 32
    low = (_byte_at(blk + 4 + j // 2, mask) >> ((j % 2) * 4)) & 15
    high = (_byte_at(blk + 2 + j // 4, mask) >> ((j % 4) * 2)) & 3
    sc = (low | (high << 4)).to(tl.float32) - 32.0
    q = _nibble_of_32(blk + 8 + 16 * j, v % 32, mask)
    return (_half_at(blk, mask) * sc) * _table_entry(q, IQ4_LOW, IQ4_HIGH, True)


@triton.jit
def _mxfp4(row, col, mask):
    """MXFP4 as GGUF lays it (32, 17): 2^(e - 128) doubled_e2m1[q], e the e8m0 byte at 0 (its float32 built from
    bits, e < 2 a subnormal), q value v of the 16 bytes at 1."""
    blk = row + (col // 32) * 17
    e = _byte_at(blk, mask)
    # e & 1 is e where the subnormal branch is taken, and keeps the other lanes' shift in range (LLVM's shl past
    # the width is poison)
    scale = tl.where(e < 2, 0x00200000 << (e & 1), (e - 1) << 23).to(tl.float32, bitcast=True)
    q = _nibble_of_32(blk + 1, col % 32, mask)
    return scale * _table_entry(q, MXFP4_HALF, MXFP4_HALF, False)


@triton.jit
def gguf_weights(row, col, mask, GGML: tl.constexpr):
    """float32 weights at input `col` of the rows of GGUF blocks starting at byte pointers `row` (broadcast
    against each other; masked weights read 0), of the type GGUF_KERNEL_TYPES names GGML."""
    if GGML == 0:
        w = _q8_0(row, col, mask)
    elif GGML == 1:
        w = _q4_k(row, col, mask)
    elif GGML == 2:
        w = _q6_k(row, col, mask)
    elif GGML == 3:
        w = _q4_0(row, col, mask)
    elif GGML == 4:
        w = _q5_k(row, col, mask)
    elif GGML == 5:
        w = _iq4_nl(row, col, mask)
    elif GGML == 6:
        w = _iq4_xs(row, col, mask)
    elif GGML == 7:
        w = _mxfp4(row, col, mask)
    elif GGML == 8:
        w = _q4_1(row, col, mask)
    elif GGML == 9:
        w = _q5_0(row, col, mask)
    else:
        tl.static_assert(GGML == 10, "GGML: a value of GGUF_KERNEL_TYPES")
        w = _q5_1(row, col, mask)
    return w


# ---- tiles of 256 inputs: [rows, 8, 32], input k0 + 32 s + i (s [1, 8, 1], i [1, 1, 32]) ----------------------------
@triton.jit
def _q4_k_tile(blk, s, i, rows_ok, mask):
    """Q4_K's block at byte pointers blk [N, 1, 1]: sub-block s's codes are nibble s % 2 (low first) of bytes
    16 + 32 (s // 2) + i, its scale and min loaded once ([N, 8, 1])."""
    sc, mn = _k_scale_min(blk + 4, s, rows_ok)
    q = ((_byte_at(blk + 16 + 32 * (s // 2) + i, mask) >> ((s % 2) * 4)) & 15).to(tl.float32)
    return (_half_at(blk, rows_ok) * sc) * q - _half_at(blk + 2, rows_ok) * mn


@triton.jit
def _q5_k_tile(blk, s, i, rows_ok, mask):
    """Q5_K's block: Q4_K's tile, its codes' low 4 bits at byte 48 on and their fifth bit bit s of byte 16 + i."""
    sc, mn = _k_scale_min(blk + 4, s, rows_ok)
    high = (_byte_at(blk + 16 + i, mask) >> s) & 1
    low = (_byte_at(blk + 48 + 32 * (s // 2) + i, mask) >> ((s % 2) * 4)) & 15
    q = (low | (high << 4)).to(tl.float32)
    return (_half_at(blk, rows_ok) * sc) * q - _half_at(blk + 2, rows_ok) * mn


@triton.jit
def _q6_k_tile(blk, s, i, rows_ok, mask):
    """Q6_K's block: input 32 s + i's low 4 bits nibble (s // 2) % 2 of byte 64 (s // 4) + 32 (s % 2) + i, its high
    2 bits pair s % 4 of byte 128 + 32 (s // 4) + i, its scale the int8 at 192 + 2 s (i < 16) or 193 + 2 s."""
    low = (_byte_at(blk + 64 * (s // 4) + 32 * (s % 2) + i, mask) >> (((s // 2) % 2) * 4)) & 15
    high = (_byte_at(blk + 128 + 32 * (s // 4) + i, mask) >> ((s % 4) * 2)) & 3
    q = (low | (high << 4)).to(tl.float32) - 32.0
    first = tl.load(blk + 192 + 2 * s, mask=rows_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    second = tl.load(blk + 193 + 2 * s, mask=rows_ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return (_half_at(blk + 208, rows_ok) * tl.where(i < 16, first, second)) * q


@triton.jit
def _iq4_xs_tile(blk, s, i, rows_ok, mask):
    """IQ4_XS's block: sub-block s's 6-bit scale once ([N, 8, 1], as `_iq4_xs`), its codes value i of the 16
    bytes at 8 + 16 s."""
    low = (_byte_at(blk + 4 + s // 2, rows_ok) >> ((s % 2) * 4)) & 15
    high = (_byte_at(blk + 2 + s // 4, rows_ok) >> ((s % 4) * 2)) & 3
    sc = (low | (high << 4)).to(tl.float32) - 32.0
    q = _nibble_of_32(blk + 8 + 16 * s, i, mask)
    return (_half_at(blk, rows_ok) * sc) * _table_entry(q, IQ4_LOW, IQ4_HIGH, True)


@triton.jit
def gguf_tile(row, k0, s, i, rows_ok, read_cols, GGML: tl.constexpr):
    """float32 weights [N, 8, 32] at inputs k0 + 32 s + i (k0 a multiple of 256; s [1, 8, 1] and i [1, 1, 32] the
    aranges) of the rows of GGUF blocks at byte pointers `row` [N, 1, 1]; rows not `rows_ok` and inputs from
    `read_cols` on read 0. The 256-value types decode a block a tile; the others as `gguf_weights`."""
    col = k0 + 32 * s + i
    mask = rows_ok & (col < read_cols)
    if GGML == 1:
        w = _q4_k_tile(row + (k0 // 256) * 144, s, i, rows_ok, mask)
    elif GGML == 2:
        w = _q6_k_tile(row + (k0 // 256) * 210, s, i, rows_ok, mask)
    elif GGML == 4:
        w = _q5_k_tile(row + (k0 // 256) * 176, s, i, rows_ok, mask)
    elif GGML == 6:
        w = _iq4_xs_tile(row + (k0 // 256) * 136, s, i, rows_ok, mask)
    else:
        w = gguf_weights(row, col, mask, GGML)
    return tl.where(mask, w, 0.0)
