"""GGUF block types dequantized in torch: the plain-torch twin of the GGUF expert formats' kernels, and
what the host reads their banks with (services/worker/expert_formats/gguf_*.py).

A GGUF row of `cols` values is `cols / block_size` blocks of `type_size` bytes (ggml's layout, as
llama.cpp writes it; little-endian), so a slot's row of an expert is the file's bytes unchanged:

| type | block | bytes | a block |
| --- | --- | --- | --- |
| Q8_0 | 32 | 34 | fp16 d, 32 int8 q: w = d q |
| Q4_0 | 32 | 18 | fp16 d, 16 bytes of 4-bit q (the low nibbles are values 0-15, the high 16-31): w = d (q - 8) |
| Q4_1 | 32 | 20 | fp16 d, fp16 m, Q4_0's 16 bytes: w = d q + m |
| Q5_0 | 32 | 22 | fp16 d, 32 bits of fifth bits (bit j: value j), Q4_0's 16 bytes: w = d (q - 16) |
| Q5_1 | 32 | 24 | fp16 d, fp16 m, Q5_0's fifth bits and nibbles: w = d q + m |
| Q4_K | 256 | 144 | fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of 4-bit q: |
| | | | w = d sc_j q - dmin m_j over 8 sub-blocks of 32 (in each 64, the low nibbles first) |
| Q5_K | 256 | 176 | Q4_K's, with a fifth bit per value from 32 bytes of qh (bit j of byte i: value 32 j + i) |
| Q6_K | 256 | 210 | 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d: w = d sc (q - 32) |
| IQ4_NL | 32 | 18 | fp16 d, Q4_0's 16 bytes of 4-bit indices into the non-linear grid kvalues_iq4nl: w = d grid[q] |
| IQ4_XS | 256 | 136 | fp16 d, a uint16 of eight 2-bit scale highs, 4 bytes of eight 4-bit scale lows, 128 bytes of |
| | | | 4-bit indices: w = d (sc_j - 32) grid[q] over 8 sub-blocks of 32 (each Q4_0's nibble order) |
| MXFP4 | 32 | 17 | e8m0 e, 16 bytes of e2m1 codes (Q4_0's nibble order): w = 2^(e - 128) 2 e2m1(q), ggml's |
| | | | doubled code table under half the scale (e of 0 and 1: the float32 subnormals 2^-128, 2^-127) |

Transcribed from ggml's `dequantize_row_*` (ggml-quants.c) as the gguf package's numpy reference
(`gguf.quants.dequantize`) writes them; the tests hold this to that reference bit for bit. Math in float32,
one rounding to the output dtype.
"""

from __future__ import annotations

import torch

# ggml type name -> (values per block, bytes per block)
BLOCKS = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
    "MXFP4": (32, 17),
}
# IQ4_NL's and IQ4_XS's 16 values an index picks (ggml's kvalues_iq4nl), non-linear to fit weights' bell shape
IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# ggml's e2m1 code table, doubled (kvalues_mxfp4): the codes' values times two, sign in the top bit
MXFP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
K_SCALE_BYTES = 12  # Q4_K / Q5_K: eight 6-bit scales and eight 6-bit mins


def row_bytes(ggml_type: str, cols: int) -> int:
    """Bytes of one row of `cols` values; a ValueError unless cols is a whole number of blocks."""
    block, size = BLOCKS[ggml_type]
    if cols % block:
        raise ValueError(f"{ggml_type} rows hold whole blocks of {block} values, got {cols}")
    return cols // block * size


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).to(torch.float32)


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes a block -> (scales, mins), uint8 [n, 8] of 6 bits each. Bytes 0-3 hold scales
    0-3 in their low 6 bits, 4-7 mins 0-3, 8-11 scales 4-7 (low nibble) and mins 4-7 (high nibble), whose
    top two bits are the top two bits of bytes 0-3 (scales) and 4-7 (mins)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _nibbles(qs: torch.Tensor, n: int) -> torch.Tensor:
    """[n, 128] bytes -> [n, 8, 32] 4-bit values: in each 32 bytes the low nibbles (32 values), then the high."""
    q = qs.view(n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).view(1, 1, 2, 1)
    return (q & 0x0F).view(n, 8, 32)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32] 4-bit values: the low nibbles (values 0-15), then the high (16-31)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> [n, 32] bits, bit j of the word at j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).view(1, 1, 8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * (_low_high(blocks[:, 2:18]).to(torch.float32) - 8.0)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _low_high(blocks[:, 4:20]).to(torch.float32) + _half(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _low_high(blocks[:, 6:22]) | (_fifth_bits(blocks[:, 2:6]) << 4)
    return _half(blocks, 0) * (q.to(torch.float32) - 16.0)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _low_high(blocks[:, 8:24]) | (_fifth_bits(blocks[:, 4:8]) << 4)
    return _half(blocks, 0) * q.to(torch.float32) + _half(blocks, 2)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = k_scales(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:144], n).to(torch.float32)
    return ((d * sc.to(torch.float32)).unsqueeze(-1) * q - (dmin * mn.to(torch.float32)).unsqueeze(-1)).view(n, 256)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
    q = (_nibbles(blocks[:, 48:176], n) | ((qh & 1) << 4)).to(torch.float32)
    return ((d * sc.to(torch.float32)).unsqueeze(-1) * q - (dmin * mn.to(torch.float32)).unsqueeze(-1)).view(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    shifts = blocks.new_tensor([0, 4]).view(1, 1, 2, 1)
    ql = ((blocks[:, 0:128].reshape(n, 2, 1, 64) >> shifts) & 0x0F).view(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> blocks.new_tensor([0, 2, 4, 6]).view(1, 1, 4, 1)
    q = (ql | ((qh & 0x03).view(n, 8, 32) << 4)).to(torch.float32) - 32.0
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    return (_half(blocks, 208) * scales).view(n, 16, 1).mul(q.view(n, 16, 16)).view(n, 256)


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    grid = torch.tensor(IQ4_GRID, dtype=torch.float32, device=blocks.device)
    return _half(blocks, 0) * grid[_low_high(blocks[:, 2:18]).long()]


def iq4_xs_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS: the eight 6-bit sub-block scales of each block, minus 32, float32 [n, 8]: sub-block j's low 4
    bits are nibble j % 2 of byte 4 + j // 2 (low nibble first), its high 2 bits bits 2j-2j+1 of the uint16 at 2."""
    n = blocks.shape[0]
    low = (blocks[:, 4:8].reshape(n, 4, 1) >> blocks.new_tensor([0, 4]).view(1, 1, 2)).reshape(n, 8) & 0x0F
    high_bits = blocks[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    high = (high_bits >> torch.arange(0, 16, 2, dtype=torch.int32, device=blocks.device).view(1, 8)) & 0x03
    return (low.to(torch.int32) | (high << 4)).to(torch.float32) - 32.0


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    grid = torch.tensor(IQ4_GRID, dtype=torch.float32, device=blocks.device)
    q = _low_high(blocks[:, 8:136].reshape(n * 8, 16)).view(n, 8, 32)
    dl = _half(blocks, 0) * iq4_xs_scales(blocks)
    return (dl.unsqueeze(-1) * grid[q.long()]).view(n, 256)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: e8m0 bytes [n, 1] -> 2^(e - 128) float32, built from its bits (e < 2: subnormal)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(MXFP4_DOUBLED, dtype=torch.float32, device=blocks.device)
    return _e8m0_half(blocks[:, 0:1]) * table[_low_high(blocks[:, 1:17]).long()]


_DEQUANTIZE = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "MXFP4": _mxfp4,
}


def dequantize_rows(q: torch.Tensor, ggml_type: str, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [O, row bytes] of `ggml_type` blocks -> [O, cols] in `dtype` (float32 math, one rounding)."""
    block, size = BLOCKS[ggml_type]
    rows, nbytes = q.shape
    if nbytes % size:
        raise ValueError(f"{ggml_type} rows are whole blocks of {size} bytes, got {nbytes}")
    blocks = q.reshape(-1, size)
    return _DEQUANTIZE[ggml_type](blocks).reshape(rows, nbytes // size * block).to(dtype)
