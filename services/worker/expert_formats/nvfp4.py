"""The `nvfp4` expert format's worker side (nvidia modelopt and compressed-tensors NVFP4 checkpoints;
plan/expert_formats/nvfp4.py prices its rows and recognizes the checkpoints).

Per weight family the byte row holds (plan/expert_formats/nvfp4.py): the e2m1 codes uint8 [O, IN/2]
(element 2j in the low nibble), the float8_e4m3fn scales [O, IN/16] of every 16 inputs, and a
float32 scale per row: the projection's per-tensor scale (modelopt's weight_scale_2, or 1 / the
compressed-tensors global scale), one per row because w13 stacks two projections (gate and up)
whose scales differ. A 35B expert is 1.78 MB here against 6.29 MB in bf16. The kernels dequantize
in registers (W4A16: Hopper has no FP4 tensor cores): kernels/quantized_expert_gemm.py and
kernels/quantized_expert_gemv.py read the views `gemm_views` gives (kernels/quantized_experts.py).
Here too: the host reader's decode of its rows (Nvfp4FamilyReader), the host kernel's code, the dummy
weights of `--load-format dummy`, and modelopt's NVFP4 tensors of one linear (`quantize_linear`, what
`ferry make-bench-model --format nvfp4` writes).

What every quantized worker format gives (the checklist: services/worker/expert_formats/__init__.py):
`plan` and `name`, `_write` and `_fill_dummy` of its parts, `host_kernel_code`, `family_reader`, and
`quantize_linear` where make-bench-model writes its layout."""

from __future__ import annotations

import torch

from ferry.kernels.quantized_experts import NVFP4_GROUP, QuantizedFamily
from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats.quantized import (
    E2M1_MAX,
    E2M1_RMS,
    E4M3_MAX,
    QuantizedExperts,
    dummy_pattern,
    e2m1_codes,
    expert_windows,
    fill_bytes_of,
    part,
    raw,
)
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute import host_expert_weights as W
from ferry.services.worker.quantized_weight import NVFP4, QuantizedWeight


def quantize_linear(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear [O, IN] in modelopt's NVFP4 tensors (IN a multiple of 16): `weight` uint8 [O, IN/2] (two
    e2m1 codes, element 2j in the low nibble), `weight_scale` float8_e4m3fn [O, IN/16], `weight_scale_2`
    fp32 (= amax / (6 x 448)) and `input_scale` fp32, as modelopt computes them: weight ~ e2m1 x
    weight_scale x weight_scale_2. Round to nearest on the e2m1 grid (a tie to the smaller magnitude)."""
    w = w.to(torch.float32)
    o, n = w.shape
    if n % NVFP4_GROUP:
        raise ValueError(f"nvfp4 needs the input size to be a multiple of {NVFP4_GROUP}, got {n}")
    amax = w.abs().max().clamp(min=1e-12)
    scale_2 = amax / (E2M1_MAX * E4M3_MAX)
    groups = w.view(o, n // NVFP4_GROUP, NVFP4_GROUP)
    block = (groups.abs().amax(-1) / (E2M1_MAX * scale_2)).to(torch.float8_e4m3fn).to(torch.float32)
    block = torch.where(block == 0, 1.0, block).to(torch.float8_e4m3fn)  # an all-zero group: modelopt's 1
    codes = e2m1_codes(groups / (block.to(torch.float32)[..., None] * scale_2)).view(o, n)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {
        "weight": packed.contiguous(),
        "weight_scale": block.contiguous(),
        "weight_scale_2": scale_2.reshape(()),
        "input_scale": torch.tensor(1.0 / E4M3_MAX / E2M1_MAX),
    }


class Nvfp4FamilyReader(W.QuantizedFamilyReader):
    """The host reader of one nvfp4 family: codes and group scales as float16 bits, times the row scale
    (host_expert_weights.py's decoders, read through the module: one place to test them)."""

    def __init__(self, family: QuantizedFamily, dtype: torch.dtype, chunk: int = W.DECODE_CHUNK):
        super().__init__(family, dtype, chunk)
        self.scale_codes = torch.empty(self.chunk_rows, family.cols // NVFP4_GROUP, dtype=torch.int16)
        self.group_scales = torch.empty(self.chunk_rows, family.cols // NVFP4_GROUP, dtype=torch.float32)

    def decode_rows(self, f: QuantizedFamily, expert: int, r0: int, r1: int, stage: torch.Tensor) -> None:
        n = r1 - r0
        stage.copy_(W.e2m1_as_fp16(W.nibble_codes(f.q[expert, r0:r1], self.words[:n])))
        scales = self.group_scales[:n].copy_(W.e4m3_as_fp16(f.scale[expert, r0:r1], self.scale_codes[:n]))
        # e2m1 x group scale is exact; then the row scale rounds once: the reference's order
        stage.view(n, -1, NVFP4_GROUP).mul_(scales.mul_(W.E4M3_IN_FP16 * W.E2M1_IN_FP16).unsqueeze(-1))
        stage.mul_(f.gscale[expert, r0:r1].unsqueeze(-1))


class Nvfp4Experts(QuantizedExperts):
    plan = F.get(F.NVFP4)
    name = plan.name
    host_kernel_code = K.NVFP4
    family_reader = Nvfp4FamilyReader
    quantize_linear = staticmethod(quantize_linear)

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
        fill_bytes_of(rows, gscale, std / E2M1_RMS)
