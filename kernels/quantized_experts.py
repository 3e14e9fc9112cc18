"""Expert weights held quantized in their slots: what the expert GEMV/GEMM kernels read for the NVFP4,
MXFP4 and FP8-block formats, and their dequantization (docs/ARCHITECTURE.md §3, "Expert formats").

A quantized slot keeps each weight family of an expert (w13 = [gate; up] with [2I, H] values, w2 =
down with [H, I]) as one row of bytes, so one expert is still one contiguous copy per family from
the host banks into its slot (kernels/expert_copy.py copies bytes; the copy engine too). Inside a
row the parts lie one after the other, each at a 16-byte boundary (plan/expert_formats/ prices
the same layout). `QuantizedFamily` holds the typed strided views of those parts over all slots:

* **nvfp4** (W4A16 on Hopper: no FP4 tensor cores, so the kernels dequantize in registers):
  `q` uint8 [S, O, IN/2], two e2m1 codes per byte, element 2j in the low nibble of byte j and
  2j+1 in the high one (nvidia modelopt's and compressed-tensors' order); `scale` float8_e4m3fn
  [S, O, IN/16], one per group of 16 consecutive inputs; `gscale` float32 [S, O], the per-tensor
  scale of the projection the row came from (modelopt's `weight_scale_2`, or 1 /
  compressed-tensors' `weight_global_scale`), kept per row because gate and up have their own.
  w[o, i] = e2m1(code[o, i]) * float(scale[o, i // 16]) * gscale[o].
* **mxfp4** (OCP microscaling, gpt-oss; W4A16 the same way): `q` as nvfp4's; `scale` uint8 [S, O, IN/32],
  one e8m0 byte per group of 32 consecutive inputs, worth 2^(s - 127); no `gscale`.
  w[o, i] = e2m1(code[o, i]) * 2^(scale[o, i // 32] - 127). The two fp4 formats share their kernels'
  body: `FP4_SCALES` gives each one's group size, scale kind and whether it has a row scale.
* **fp8-block** (Qwen's `-FP8` releases, W8A16): `q` float8_e4m3fn [S, O, IN]; `scale` float32
  [S, P * ceil(part_rows / 128), ceil(IN / 128)], one per block of 128 x 128 of each part (w13's
  gate and up are separate projections whose blocks restart at row I; w2 is one part), partial
  blocks at the edges included. w[o, i] = float(q[o, i]) * scale[row_block(o), i // 128] with
  row_block(o) = (o // part_rows) * ceil(part_rows / 128) + (o % part_rows) // 128.

* **GGUF blocks** (a GGUF file's experts, `ggml_type` set): `q` uint8 [S, O, row bytes], the file's blocks
  unchanged, their scales inside, decoded by the twin (kernels/gguf_blocks.py) and, for the types in
  kernels/gguf_block_decode.py's GGUF_KERNEL_TYPES, by the Triton kernels (gguf_expert_gemv.py, gguf_expert_gemm.py).
  A file mixing types by layer (`gguf-mixed`) gives each MoE layer its own family, `q` a prefix of the slots' longer
  rows.

Dequantization is computed in float32 and rounded once to the activations' dtype; the kernels do
the same per element, so the reference (dequantize the slot, then the plain reference GEMM:
`quantized_expert_rows_reference`, kernels/grouped_expert_gemm_reference.py) is their twin.
The e2m1 magnitudes by code (bits 0-2; bit 3 is the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.kernels.expert_epilogue import SILU_AND_MUL, ExpertActivation
from ferry.kernels.gguf_blocks import dequantize_rows

# the formats' names and constants have one owner, the torch-free layout module
from ferry.plan.expert_formats import (  # noqa: F401
    E2M1_VALUES,
    E8M0_BIAS,
    FP8_BLOCK,
    FP8_BLOCK_SIZE,
    MXFP4,
    MXFP4_GROUP,
    NVFP4,
    NVFP4_GROUP,
)
from ferry.shared.units import ceil_div


@dataclass(frozen=True)
class Fp4Scales:
    """How an fp4 format scales its e2m1 codes: the kernels' constexpr parameters."""

    group: int  # inputs per scale
    e8m0: bool  # scale bytes are e8m0 (2^(s - 127)); else float8_e4m3fn
    row_scale: bool  # a float32 scale per row (`gscale`) multiplies the rest


FP4_SCALES = {
    NVFP4: Fp4Scales(group=NVFP4_GROUP, e8m0=False, row_scale=True),
    MXFP4: Fp4Scales(group=MXFP4_GROUP, e8m0=True, row_scale=False),
}


@dataclass(frozen=True)
class QuantizedFamily:
    """One weight family of S quantized slots: typed views (see the module docstring) into one
    uint8 [S, row_bytes] buffer. `rows` = O outputs per slot, `cols` = IN inputs, `part_rows` =
    rows per projection (I for w13, H for w2)."""

    fmt: str
    rows: int
    cols: int
    part_rows: int
    q: torch.Tensor
    scale: torch.Tensor | None = None  # None: GGUF blocks keep their scales inside `q`
    gscale: torch.Tensor | None = None
    ggml_type: str | None = None  # GGUF blocks (kernels/gguf_blocks.py): `q` [S, O, row bytes] of this type
    # the experts' biases (float32 [S, rows], a view of the rows' bias part) where they have them, and the
    # activation the gate/up family's output takes (kernels/expert_epilogue.py)
    bias: torch.Tensor | None = None
    activation: ExpertActivation = SILU_AND_MUL

    @property
    def num_slots(self) -> int:
        return self.q.shape[0]

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def parts(self) -> int:
        return self.rows // self.part_rows

    @property
    def row_blocks_per_part(self) -> int:
        return ceil_div(self.part_rows, FP8_BLOCK_SIZE)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (low 4 bits) -> float32 e2m1 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    magnitude = table[c & 7]
    return torch.where((c & 8) != 0, -magnitude, magnitude)


def unpack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N/2] -> uint8 codes [..., N]: the low nibble first."""
    low, high = q & 0x0F, q >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def row_block_index(rows: int, part_rows: int, device=None) -> torch.Tensor:
    """fp8-block: the scale row of each of `rows` rows (blocks restart at every part)."""
    o = torch.arange(rows, device=device)
    return (o // part_rows) * ceil_div(part_rows, FP8_BLOCK_SIZE) + (o % part_rows) // FP8_BLOCK_SIZE


def dequantize_nvfp4(q: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[O, IN] in `dtype` from codes q [O, IN/2], float8 group scales [O, IN/16] and the per-row (or
    per-tensor: broadcast) float32 scale: e2m1 x group scale x row scale, float32 math, one rounding."""
    values = e2m1_decode(unpack_nibbles(q))
    groups = scale.to(torch.float32).repeat_interleave(NVFP4_GROUP, dim=1)[:, : values.shape[1]]
    return (values * groups * row_scale.to(torch.float32).reshape(-1, 1)).to(dtype)


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 bytes -> float32 2^(s - 127) (byte 0: 2^-127, a float32 subnormal; 255: inf)."""
    return torch.ldexp(torch.ones(scale.shape, device=scale.device), scale.to(torch.int32) - E8M0_BIAS)


def dequantize_mxfp4(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[O, IN] in `dtype` from codes q [O, IN/2] and e8m0 group scales uint8 [O, IN/32]: e2m1 x 2^(s - 127),
    exact in float32, one rounding."""
    values = e2m1_decode(unpack_nibbles(q))
    return (values * e8m0_decode(scale).repeat_interleave(MXFP4_GROUP, dim=1)).to(dtype)


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, part_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[O, IN] in `dtype` from float8 q [O, IN] and the float32 scales of its 128 x 128 blocks, whose
    rows restart every `part_rows` rows (w13's gate and up; a single projection: part_rows = O)."""
    rows, cols = q.shape
    blocks = scale.to(torch.float32)[row_block_index(rows, part_rows, q.device)]
    return (q.to(torch.float32) * blocks.repeat_interleave(FP8_BLOCK_SIZE, dim=1)[:, :cols]).to(dtype)


def dequantize_slot(family: QuantizedFamily, slot: int, dtype: torch.dtype) -> torch.Tensor:
    """Slot `slot`'s weights as a dense [O, IN] tensor of `dtype` (float32 math, one rounding)."""
    if family.ggml_type is not None:
        return dequantize_rows(family.q[slot], family.ggml_type, dtype)
    if family.fmt == NVFP4:
        return dequantize_nvfp4(family.q[slot], family.scale[slot], family.gscale[slot], dtype)
    if family.fmt == MXFP4:
        return dequantize_mxfp4(family.q[slot], family.scale[slot], dtype)
    if family.fmt == FP8_BLOCK:
        return dequantize_fp8_blocks(family.q[slot], family.scale[slot], family.part_rows, dtype)
    raise ValueError(f"unknown quantized expert format {family.fmt!r}")
