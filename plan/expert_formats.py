"""Expert formats: how the routed experts are held in host RAM, in their GPU slots and across PCIe.

One concept, four formats (docs/ARCHITECTURE.md §3, "Expert formats"):

| format | host banks | slots | what one copy moves |
| --- | --- | --- | --- |
| `bf16` | as the slots hold them | the run dtype, [2I, H] and [H, I] | 6 I H bytes |
| `bf16-packed` | 12 bits a value, lossless | the run dtype | 4.5 I H bytes, unpacked as it lands |
| | (kernels/expert_pack.py) | | |
| `nvfp4` | as the slots hold them | e2m1 codes + float8 group scales + per-row fp32 scales | ~1.69 I H bytes |
| `fp8-block` | as the slots hold them | float8_e4m3fn + fp32 128x128 block scales | ~3 I H bytes |

(`bf16` is the unquantized format in whatever dtype the model runs: float32 in the CPU tests.)
The quantized formats keep each weight family of an expert (w13 = [gate; up], w2 = down) as one row
of bytes: its parts one after the other, each at a PART_ALIGN boundary, so an expert is still one
contiguous copy per family, and the kernels read typed views of the parts
(kernels/quantized_experts.py). This module is the one price of those rows: the pool layout
(pool_layout.expert_slot_layout), the host banks (host_memory.expert_bank_bytes) and the worker's
views all come from `family_layout`. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.plan.model_config import DTYPE_BYTES, ModelSpec
from ferry.shared.units import ceil_div, round_up

BF16, BF16_PACKED, NVFP4, FP8_BLOCK = "bf16", "bf16-packed", "nvfp4", "fp8-block"
FORMATS = (BF16, BF16_PACKED, NVFP4, FP8_BLOCK)
QUANTIZED = (NVFP4, FP8_BLOCK)
PART_ALIGN = 16  # every part of a quantized row starts here: vector loads, and fp32 views of the bytes
NVFP4_GROUP = 16  # inputs per float8 scale
FP8_BLOCK_SIZE = 128  # rows and columns per float32 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by code (bits 0-2; bit 3 is the sign)


@dataclass(frozen=True)
class RowPart:
    name: str  # q | scale | gscale
    dtype: str  # uint8 | float8_e4m3fn | float32
    shape: tuple[int, ...]  # per slot
    offset: int  # bytes from the row's start

    @property
    def nbytes(self) -> int:
        n = {"uint8": 1, "float8_e4m3fn": 1, "float32": 4}[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class FamilyLayout:
    """One weight family of one expert in a quantized format: `rows` outputs, `cols` inputs,
    `part_rows` rows per projection (w13's gate and up are two), and its parts in one byte row."""

    fmt: str
    rows: int
    cols: int
    part_rows: int
    parts: tuple[RowPart, ...]
    nbytes: int


def family_layout(fmt: str, rows: int, cols: int, part_rows: int) -> FamilyLayout:
    """The byte row of one family (rows x cols values) in quantized format `fmt`."""
    if fmt == NVFP4:
        if cols % NVFP4_GROUP:
            raise ValueError(f"nvfp4 needs the input size ({cols}) to be a multiple of {NVFP4_GROUP}")
        shapes = (
            ("q", "uint8", (rows, cols // 2)),
            ("scale", "float8_e4m3fn", (rows, cols // NVFP4_GROUP)),
            ("gscale", "float32", (rows,)),
        )
    elif fmt == FP8_BLOCK:
        row_blocks = (rows // part_rows) * ceil_div(part_rows, FP8_BLOCK_SIZE)
        shapes = (
            ("q", "float8_e4m3fn", (rows, cols)),
            ("scale", "float32", (row_blocks, ceil_div(cols, FP8_BLOCK_SIZE))),
        )
    else:
        raise ValueError(f"{fmt!r} is not a quantized expert format ({', '.join(QUANTIZED)})")
    parts, cursor = [], 0
    for name, dtype, shape in shapes:
        part = RowPart(name, dtype, shape, cursor)
        parts.append(part)
        cursor = round_up(cursor + part.nbytes, PART_ALIGN)
    return FamilyLayout(fmt, rows, cols, part_rows, tuple(parts), cursor)


def slot_format(spec: ModelSpec) -> str:
    """What the slots hold: the checkpoint's quantized expert format, else the run dtype (`bf16`)."""
    q = spec.quantization
    return q.expert_format if q is not None and q.expert_format else BF16


def expert_layouts(spec: ModelSpec) -> tuple[FamilyLayout, FamilyLayout]:
    """(w13, w2) byte rows of a model whose experts are quantized."""
    h, i = spec.hidden_size, spec.moe_intermediate_size
    fmt = slot_format(spec)
    return family_layout(fmt, 2 * i, h, i), family_layout(fmt, h, i, h)


def slot_family_bytes(spec: ModelSpec, dtype: str) -> tuple[int, int]:
    """Bytes of one slot's (w13, w2)."""
    if slot_format(spec) == BF16:
        h, i = spec.hidden_size, spec.moe_intermediate_size
        return 2 * i * h * DTYPE_BYTES[dtype], h * i * DTYPE_BYTES[dtype]
    w13, w2 = expert_layouts(spec)
    return w13.nbytes, w2.nbytes


def expert_format_name(spec: ModelSpec, bank_format: str, dtype: str = "bfloat16") -> str:
    """The format's name for the plan, /metrics and `generate --json`: the slot format, or for
    unquantized experts the banks' (`bf16-packed` when packed; the run dtype's name for plain
    experts in another dtype than bf16, e.g. `float32` on CPU)."""
    fmt = slot_format(spec)
    if fmt != BF16:
        return fmt
    if bank_format == "packed":
        return BF16_PACKED
    return BF16 if dtype == "bfloat16" else dtype
