"""The `nvfp4` expert format (nvidia modelopt and compressed-tensors NVFP4 checkpoints).

Per weight family the byte row holds (plan/expert_formats.py): the e2m1 codes uint8 [O, IN/2]
(element 2j in the low nibble), the float8_e4m3fn scales [O, IN/16] of every 16 inputs, and a
float32 scale per row: the projection's per-tensor scale (modelopt's weight_scale_2, or 1 / the
compressed-tensors global scale), one per row because w13 stacks two projections (gate and up)
whose scales differ. A 35B expert is 1.78 MB here against 6.29 MB in bf16. The kernels dequantize
in registers (W4A16: Hopper has no FP4 tensor cores)."""

from __future__ import annotations

import torch

from ferry.kernels.quantized_experts import E2M1_VALUES
from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats.quantized import (
    QuantizedExperts,
    dummy_pattern,
    expert_windows,
    fill_bytes_of,
    part,
    raw,
)
from ferry.services.worker.quantized_weight import NVFP4, QuantizedWeight

# the root mean square of a uniformly random e2m1 code: what a dummy weight's scales divide by
_E2M1_RMS = (sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)) ** 0.5


class Nvfp4Experts(QuantizedExperts):
    name = F.NVFP4

    def _write(self, row: torch.Tensor, layout: F.FamilyLayout, projections: tuple[QuantizedWeight, ...]) -> None:
        parts = {p.name: part(row, p) for p in layout.parts}
        first = 0
        for proj in projections:
            if proj.fmt != NVFP4:
                raise ValueError(
                    f"checkpoint tensor {proj.source!r} is {proj.fmt}, but the routed experts are nvfp4 "
                    "(config.json's quantization_config): every expert must be nvfp4"
                )
            rows = proj.q.shape[0]
            parts["q"][first : first + rows].copy_(proj.q)
            parts["scale"][first : first + rows].copy_(proj.scale)
            parts["gscale"][first : first + rows].copy_(proj.global_scale.expand(rows))
            first += rows

    def _fill_dummy(self, rows: torch.Tensor, layout: F.FamilyLayout, std: float, gen: torch.Generator) -> None:
        """Random codes (every nibble is a valid value), group scales of 1 and a row scale that
        gives the weights about `std`."""
        q, scale, gscale = layout.parts
        experts, width = rows.shape[0], q.nbytes
        pattern = torch.randint(0, 256, (dummy_pattern(experts, width),), dtype=torch.uint8, generator=gen)
        raw(rows, q).copy_(expert_windows(pattern, experts, width))
        fill_bytes_of(rows, scale, 1.0)
        fill_bytes_of(rows, gscale, std / _E2M1_RMS)
