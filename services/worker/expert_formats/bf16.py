"""The `bf16` expert format: experts in the run dtype (bf16 on a GPU, float32 in the CPU tests), in
slots w13 [S, 2I, H] (gate rows, then up rows) and w2 [S, H, I], and in host banks of the same rows.
The expert kernels read the slot tensors as they are."""

from __future__ import annotations

import torch

from ferry.services.worker.expert_formats.expert_shapes import check_expert_shapes
from ferry.services.worker.quantized_weight import QuantizedWeight


class Bf16Experts:
    quantized = False

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        self.hidden, self.inter, self.dtype = hidden, inter, dtype
        self.name = "bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch.")

    def row_shapes(self):
        h, i = self.hidden, self.inter
        return ((2 * i, h), self.dtype), ((h, i), self.dtype)

    def write_expert(self, dst13: torch.Tensor, dst2: torch.Tensor, gate, up, down, where: str) -> None:
        if any(isinstance(t, QuantizedWeight) for t in (gate, up, down)):
            raise ValueError(
                f"{where} is quantized in the checkpoint, but its config.json has no quantization_config "
                "that says so: use the checkpoint's own config.json (and hf_quant_config.json)"
            )
        check_expert_shapes(where, gate, up, down, self.inter, self.hidden)
        i = self.inter
        dst13[:i].copy_(gate)
        dst13[i:].copy_(up)
        dst2.copy_(down)

    def gemm_views(self, w13: torch.Tensor, w2: torch.Tensor):
        return w13, w2
