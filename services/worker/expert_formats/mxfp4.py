"""The `mxfp4` expert format's worker side (OCP microscaling FP4, as openai's gpt-oss publishes it;
plan/expert_formats/mxfp4.py prices its rows and recognizes the checkpoints).

Per weight family the byte row holds (plan/expert_formats/mxfp4.py): the e2m1 codes uint8 [O, IN/2]
(element 2j in the low nibble, the checkpoint's `*_blocks` bytes as they lie) and the e8m0 scales
uint8 [O, IN/32] of every 32 inputs (byte s: 2^(s - 127)); no per-row scale. The kernels dequantize
in registers with the NVFP4 kernels' body (kernels/quantized_experts.py's FP4_SCALES gives the group
and the scale kind). Here too: the host reader's decode of its rows (Mxfp4FamilyReader), the host
kernel's code, the dummy weights of `--load-format dummy`, and one linear's tensors in the layout
`ferry make-bench-model --format mxfp4` writes (`quantize_linear`).

What every quantized worker format gives (the checklist: services/worker/expert_formats/__init__.py):
`plan` and `name`, `_write` and `_fill_dummy` of its parts, `host_kernel_code`, `family_reader`, and
`quantize_linear` where make-bench-model writes its layout."""

from __future__ import annotations

import math

import torch

from ferry.kernels.quantized_experts import E8M0_BIAS, MXFP4_GROUP, QuantizedFamily
from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX
from ferry.services.worker.expert_formats.quantized import (
    E2M1_MAX,
    E2M1_RMS,
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
from ferry.services.worker.quantized_weight import MXFP4, QuantizedWeight

E8M0_MAX = 254  # the largest e8m0 byte that is a number (255 is NaN in the OCP spec)
FLOAT32_EXPONENT = 23  # bits below a float32's exponent field


def quantize_linear(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear [O, IN] (IN a multiple of 32) in the mxfp4 checkpoint tensors: `weight_blocks` uint8
    [O, IN/32, 16] (two e2m1 codes a byte, element 2j in the low nibble) and `weight_scales` uint8
    [O, IN/32], weight ~ e2m1 x 2^(s - 127). Each group's scale is the smallest power of two that puts its
    largest magnitude within e2m1's 6 (none clips); codes round to nearest (a tie to the smaller magnitude).
    An all-zero group gets scale byte 127 (1.0)."""
    w = w.to(torch.float32)
    o, n = w.shape
    if n % MXFP4_GROUP:
        raise ValueError(f"mxfp4 needs the input size to be a multiple of {MXFP4_GROUP}, got {n}")
    groups = w.view(o, n // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(-1)
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX))
    # log2 rounds: move by one where the power of two is not the smallest that holds amax
    exponent = exponent + (amax > E2M1_MAX * torch.exp2(exponent)).float()
    exponent = exponent - (amax <= E2M1_MAX * torch.exp2(exponent - 1)).float()
    exponent = torch.where(amax == 0, 0.0, exponent.clamp(-E8M0_BIAS, E8M0_MAX - E8M0_BIAS))
    codes = e2m1_codes(groups / torch.exp2(exponent)[..., None]).view(o, n)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {
        BLOCKS_SUFFIX: packed.view(o, n // MXFP4_GROUP, MXFP4_GROUP // 2).contiguous(),
        SCALES_SUFFIX: (exponent + E8M0_BIAS).to(torch.uint8).contiguous(),
    }


def e8m0_as_float32(scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 bytes [...] -> float32 2^(s - 127) [...] through `out` (int32, same shape): the byte is a
    float32's exponent field (byte 0 reads 0 there: the 2^-127 subnormal, written apart)."""
    out.copy_(scales).bitwise_left_shift_(FLOAT32_EXPONENT)
    out.masked_fill_(scales == 0, 1 << (FLOAT32_EXPONENT - 1))  # 2^-127: the top mantissa bit of exponent 0
    return out.view(torch.float32)


class Mxfp4FamilyReader(W.QuantizedFamilyReader):
    """The host reader of one mxfp4 family: codes as float16 bits, times the group scales (the bits' 2^-14
    folded in: exact for every scale up to 2^113, far above any weight's)."""

    def __init__(self, family: QuantizedFamily, dtype: torch.dtype, chunk: int = W.DECODE_CHUNK):
        super().__init__(family, dtype, chunk)
        self.scale_bits = torch.empty(self.chunk_rows, family.cols // MXFP4_GROUP, dtype=torch.int32)

    def decode_rows(self, f: QuantizedFamily, expert: int, r0: int, r1: int, stage: torch.Tensor) -> None:
        n = r1 - r0
        stage.copy_(W.e2m1_as_fp16(W.nibble_codes(f.q[expert, r0:r1], self.words[:n])))
        scales = e8m0_as_float32(f.scale[expert, r0:r1], self.scale_bits[:n]).mul_(W.E2M1_IN_FP16)
        stage.view(n, -1, MXFP4_GROUP).mul_(scales.unsqueeze(-1))


class Mxfp4Experts(QuantizedExperts):
    plan = F.get(F.MXFP4)
    name = plan.name
    host_kernel_code = K.MXFP4
    family_reader = Mxfp4FamilyReader
    quantize_linear = staticmethod(quantize_linear)

    def _write(self, row: torch.Tensor, layout: F.FamilyLayout, projections: tuple[QuantizedWeight, ...]) -> None:
        parts = {p.name: part(row, p) for p in layout.parts}
        first = 0
        for proj in projections:
            if proj.fmt != MXFP4:
                raise ValueError(
                    f"checkpoint tensor {proj.source!r} is {proj.fmt}, but the routed experts are mxfp4 "
                    "(config.json's quantization_config): every expert must be mxfp4"
                )
            rows = proj.q.shape[0]
            parts["q"][first : first + rows].copy_(proj.q)
            parts["scale"][first : first + rows].copy_(proj.scale)
            first += rows

    def _fill_dummy(self, rows: torch.Tensor, layout: F.FamilyLayout, std: float, gen: torch.Generator) -> None:
        """Random codes (every nibble is a valid value) and the one power-of-two scale that gives the
        weights about `std`."""
        q, scale = layout.parts
        experts, width = rows.shape[0], q.nbytes
        pattern = torch.randint(0, 256, (dummy_pattern(experts, width),), dtype=torch.uint8, generator=gen)
        raw(rows, q).copy_(expert_windows(pattern, experts, width))
        fill_bytes_of(rows, scale, float(E8M0_BIAS + round(math.log2(std / E2M1_RMS))))
