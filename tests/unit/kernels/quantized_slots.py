"""Random quantized slots for the kernel tests: `QuantizedFamily` views over one uint8 [S, row_bytes]
buffer laid out as kernels/quantized_experts.py describes (parts in order, each at a 16-byte
boundary, one slot's parts row_bytes apart), with random valid contents. The bytes between and
after the parts are random too, so a kernel reading outside its part is not reading zeros."""

from __future__ import annotations

import math

import torch

from ferry.kernels.gguf_blocks import BLOCKS as GGUF_BLOCKS
from ferry.kernels.gguf_blocks import row_bytes as gguf_row_bytes
from ferry.kernels.quantized_experts import (
    E8M0_BIAS,
    FP8_BLOCK,
    FP8_BLOCK_SIZE,
    MXFP4,
    MXFP4_GROUP,
    NVFP4,
    NVFP4_GROUP,
    QuantizedFamily,
    ceil_div,
)

PART_ALIGN = 16


# GGUF block types the kernel tests draw (kernels/gguf_blocks.py): per type its fp16 fields, (byte offset into a
# block, value giving weights of rms ~1 before the 1 / sqrt(cols) scaling), as the worker's dummy weights set them
# (MXFP4 has none: its e8m0 byte is set as the mxfp4 format's scales are)
GGUF_TEST_TYPES = {
    "Q8_0": ((0, 1 / 73.9),),  # d: int8 codes have an rms of ~73.9
    "Q4_K": ((0, 1 / 258.3), (2, 7.5 / 258.3)),  # d, dmin: 4-bit codes under 6-bit scales, centred by dmin = 7.5 d
    "Q6_K": ((208, 1 / 1365.0),),  # d: codes - 32 (rms ~18.5) under int8 scales (rms ~73.9)
    "Q4_0": ((0, 1 / 4.6),),  # d: (q - 8) of 4 random bits has an rms of ~4.6
    "Q4_1": ((0, 1 / 4.6), (2, -7.5 / 4.6)),  # d, m: centred by m = -7.5 d
    "Q5_0": ((0, 1 / 9.2),),  # d: (q - 16) of 5 random bits has an rms of ~9.2
    "Q5_1": ((0, 1 / 9.2), (2, -15.5 / 9.2)),  # d, m: centred by m = -15.5 d
    "Q5_K": ((0, 1 / 527.0), (2, 15.5 / 527.0)),  # d, dmin: 5-bit codes under 6-bit scales, centred by dmin
    "IQ4_NL": ((0, 1 / 67.4),),  # d: the grid's values at random indices have an rms of ~67.4
    "IQ4_XS": ((0, 1 / 1246.0),),  # d: grid values under 6-bit scales (minus 32) have an rms of ~1246
    "MXFP4": (),  # its e8m0 byte at 0: set by make_family
}
# MXFP4's e2m1 codes (ggml's doubled table under half the scale) have an rms of ~2.93 times the scale 2^(e - 127)
GGUF_E2M1_RMS = 2.93


def gguf_fmt(ggml_type: str) -> str:
    """The kernel tests' name of a GGUF type as a format (plan/expert_formats' gguf-*)."""
    return f"gguf-{ggml_type.lower()}"


def _parts(fmt: str, rows: int, cols: int, part_rows: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    if fmt.startswith("gguf-"):
        return [("q", torch.uint8, (rows, gguf_row_bytes(fmt[5:].upper(), cols)))]
    if fmt == NVFP4:
        return [
            ("q", torch.uint8, (rows, cols // 2)),
            ("scale", torch.float8_e4m3fn, (rows, cols // NVFP4_GROUP)),
            ("gscale", torch.float32, (rows,)),
        ]
    if fmt == MXFP4:
        return [("q", torch.uint8, (rows, cols // 2)), ("scale", torch.uint8, (rows, cols // MXFP4_GROUP))]
    row_blocks = (rows // part_rows) * ceil_div(part_rows, FP8_BLOCK_SIZE)
    return [
        ("q", torch.float8_e4m3fn, (rows, cols)),
        ("scale", torch.float32, (row_blocks, ceil_div(cols, FP8_BLOCK_SIZE))),
    ]


def make_family(
    fmt: str,
    rows: int,
    cols: int,
    part_rows: int,
    slots: int,
    gen: torch.Generator,
    exact_bf16: bool = False,
    device: str = "cpu",
) -> QuantizedFamily:
    """S slots of one weight family (rows x cols values, projections of part_rows rows), weights of
    root mean square about 1/sqrt(cols), as the plain kernels' tests draw them. `exact_bf16`: scales
    of few significant bits (NVFP4's gscale 2, FP8's block scales 4: with the codes' 2 + 4 or 4, at
    most bf16's 8; MXFP4's are powers of two), so every weight dequantizes exactly to bf16 (the Triton
    interpreter rounds toward zero where the GPU and torch round to nearest: these weights round alike
    everywhere)."""
    layout, cursor = [], 0
    for name, dtype, shape in _parts(fmt, rows, cols, part_rows):
        nbytes = dtype.itemsize * int(torch.tensor(shape).prod())
        layout.append((name, dtype, shape, cursor, nbytes))
        cursor = -(-(cursor + nbytes) // PART_ALIGN) * PART_ALIGN
    buf = torch.randint(0, 256, (slots, cursor), dtype=torch.uint8, generator=gen)  # garbage between parts

    def views_of(b):
        return {name: b[:, off : off + n].view(dtype).unflatten(-1, shape) for name, dtype, shape, off, n in layout}

    views = views_of(buf)
    spread = lambda *shape: torch.exp2(torch.rand(*shape, generator=gen) * 2 - 1)  # noqa: E731  (0.5 .. 2, rms 1.163)
    if fmt.startswith("gguf-"):
        # random bytes are valid codes and scales; the fp16 fields get weights of rms ~1/sqrt(cols) (with
        # exact_bf16 a power of two: Q8_0's weights are then exact in bf16)
        ggml_type = fmt[5:].upper()
        size = GGUF_BLOCKS[ggml_type][1]
        blocks = views["q"].reshape(slots, -1, size)
        for offset, unit in GGUF_TEST_TYPES[ggml_type]:
            value = spread(slots, blocks.shape[1]) * unit / cols**0.5
            if exact_bf16:  # the magnitude a power of two (Q4_1's and Q5_1's m are negative)
                value = value.sign() * torch.exp2(value.abs().log2().round())
            blocks[:, :, offset : offset + 2] = value.to(torch.float16).view(torch.uint8).view(slots, -1, 2)
        if ggml_type == "MXFP4":  # e8m0 scales 2^-1 .. 2^1 around weights of rms 1/sqrt(cols), as mxfp4's below
            centre = E8M0_BIAS + round(-math.log2(GGUF_E2M1_RMS * cols**0.5))
            blocks[:, :, 0] = torch.randint(centre - 1, centre + 2, blocks.shape[:2], generator=gen, dtype=torch.uint8)
        views = views_of(buf.to(device))
        return QuantizedFamily(fmt, rows, cols, part_rows, views["q"], ggml_type=ggml_type)
    if fmt == NVFP4:
        # codes: any byte is two valid e2m1 codes (root mean square 2.93)
        gscale = 0.01 * spread(slots, rows)
        if exact_bf16:
            mantissa, exponent = torch.frexp(gscale)
            gscale = torch.ldexp((mantissa * 4).round() / 4, exponent)
        views["gscale"].copy_(gscale)
        scale = spread(slots, rows, cols // NVFP4_GROUP) / (2.93 * 1.353 * 0.01 * cols**0.5)
        views["scale"].copy_(scale.to(torch.float8_e4m3fn))
    elif fmt == MXFP4:
        # e8m0 scales: 2^-1 .. 2^1 around the power of two that gives weights of rms 1/sqrt(cols)
        centre = E8M0_BIAS + round(-math.log2(2.93 * cols**0.5))
        views["scale"].copy_(torch.randint(centre - 1, centre + 2, views["scale"].shape, generator=gen))
    elif fmt == FP8_BLOCK:
        views["q"].copy_((torch.randn(slots, rows, cols, generator=gen) * 0.5).to(torch.float8_e4m3fn))
        scale = spread(*views["scale"].shape) * 2 / (1.163 * cols**0.5)
        views["scale"].copy_(scale.to(torch.float8_e4m3fn).float() if exact_bf16 else scale)
    else:
        raise ValueError(fmt)
    views = views_of(buf.to(device))
    return QuantizedFamily(fmt, rows, cols, part_rows, views["q"], views["scale"], views.get("gscale"))


def make_experts(
    fmt: str, hidden: int, inter: int, slots: int, gen: torch.Generator, exact_bf16: bool = False, device: str = "cpu"
) -> tuple[QuantizedFamily, QuantizedFamily]:
    """(w13, w2) of `slots` experts: w13 = [gate; up] [2I, H] in parts of I rows, w2 = down [H, I]."""
    return (
        make_family(fmt, 2 * inter, hidden, inter, slots, gen, exact_bf16, device),
        make_family(fmt, hidden, inter, hidden, slots, gen, exact_bf16, device),
    )
