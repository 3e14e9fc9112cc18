"""The `gguf-mxfp4` expert format's worker side: a GGUF file's MXFP4 blocks kept as the file stores them
(services/worker/expert_formats/gguf_blocks.py; plan/expert_formats/gguf_mxfp4.py prices its rows)."""

from __future__ import annotations

import math

import torch

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.gguf_mxfp4 import GGUF_MXFP4
from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts
from ferry.services.worker.expert_formats.quantized import raw

E2M1_STD = 2.93  # random e2m1 codes (0 to 6, either sign) have a std of ~2.93
E8M0_BIAS = 127  # a scale byte s is 2^(s - 127)


class GgufMxfp4Experts(GgufBlockExperts):
    plan = F.get(GGUF_MXFP4)
    name = plan.name

    def _fill_dummy(self, rows: torch.Tensor, layout: F.FamilyLayout, std: float, gen: torch.Generator) -> None:
        """Random codes under one e8m0 scale byte (not an fp16 field: `scale_fields` does not fit) near `std`."""
        super()._fill_dummy(rows, layout, std, gen)
        (q,) = layout.parts
        blocks = raw(rows, q).view(rows.shape[0], -1, self.plan.block_bytes)
        blocks[:, :, 0] = E8M0_BIAS + round(math.log2(std / E2M1_STD))
