"""The `fp8-block` expert format (Qwen's `-FP8` checkpoints: float8_e4m3fn with 128 x 128 block scales).

Per weight family the byte row holds (plan/expert_formats.py) the float8_e4m3fn weights [O, IN]
and the float32 scales of every 128 x 128 block of each projection (w13's gate and up keep their
own block rows, restarting at row I, since partial blocks occur), as the checkpoints' scale_inv
multiplies. Per-tensor FP8 experts (modelopt FP8) are held the same way, their one scale in every
block. The kernels dequantize in registers and compute in the activations' dtype (W8A16, not W8A8:
decode reads each weight once a token, so FP8 tensor cores would not be its bottleneck, and bf16
activations keep the accuracy of the checkpoint's own dequantized weights)."""

from __future__ import annotations

import torch

from ferry.kernels.quantized_experts import FP8_BLOCK_SIZE, ceil_div
from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats.quantized import (
    QuantizedExperts,
    dummy_pattern,
    expert_windows,
    fill_bytes_of,
    part,
    raw,
)
from ferry.services.worker.quantized_weight import FP8_BLOCK, FP8_TENSOR, QuantizedWeight


class Fp8BlockExperts(QuantizedExperts):
    name = F.FP8_BLOCK

    def _write(self, row: torch.Tensor, layout: F.FamilyLayout, projections: tuple[QuantizedWeight, ...]) -> None:
        q, scale = (part(row, p) for p in layout.parts)
        blocks = ceil_div(layout.part_rows, FP8_BLOCK_SIZE)
        for n, proj in enumerate(projections):
            first = n * layout.part_rows
            q[first : first + layout.part_rows].copy_(proj.q)
            mine = scale[n * blocks : (n + 1) * blocks]
            if proj.fmt == FP8_BLOCK:
                mine.copy_(proj.scale)
            elif proj.fmt == FP8_TENSOR:
                mine.copy_(proj.scale.expand_as(mine))
            else:
                raise ValueError(
                    f"checkpoint tensor {proj.source!r} is {proj.fmt}, but the routed experts are fp8 "
                    "(config.json's quantization_config): every expert must be fp8"
                )

    def _fill_dummy(self, rows: torch.Tensor, layout: F.FamilyLayout, std: float, gen: torch.Generator) -> None:
        """Normal float8 weights (no NaN: they are cast, not drawn as bytes) under block scales of `std`."""
        q, scale = layout.parts
        experts, width = rows.shape[0], q.nbytes
        pattern = torch.randn(dummy_pattern(experts, width), generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
        raw(rows, q).copy_(expert_windows(pattern, experts, width))
        fill_bytes_of(rows, scale, std)
