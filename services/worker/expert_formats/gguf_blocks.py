"""What the GGUF expert formats' worker sides share (gguf_q8_0.py, gguf_q4_0.py, ..., gguf_q6_k.py;
plan/expert_formats/gguf_blocks.py prices their rows): one byte row per weight family holding the GGUF file's blocks
of that expert unchanged ([gate; up] rows for w13, down's for w2), so a slot, a host bank and the file hold the same
bytes; experts with biases (gpt-oss) hold them in a float32 part after the blocks. The kernels' twin decodes them
(kernels/gguf_blocks.py), and on CUDA the Triton kernels of kernels/gguf_expert_gemv.py and gguf_expert_gemm.py
(every type: kernels/gguf_block_decode.py). The host computes its banks' share with the C host kernel, which
decodes every type's blocks in its rows (kernels/host_experts_c/gguf_blocks.h), or reads them through torch
(`GgufFamilyReader`)."""

from __future__ import annotations

import numpy as np
import torch

from ferry.kernels.gguf_blocks import dequantize_rows
from ferry.kernels.quantized_experts import QuantizedFamily
from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats.quantized import QuantizedExperts, dummy_pattern, expert_windows, part, raw
from ferry.services.worker.gguf_tensors import GgufWeight
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute import host_expert_weights as W


class GgufFamilyReader(W.QuantizedFamilyReader):
    """The host reader of one family of GGUF blocks: the twin's decode, a chunk of rows at a time."""

    def decode_rows(self, f: QuantizedFamily, expert: int, r0: int, r1: int, stage: torch.Tensor) -> None:
        stage.copy_(dequantize_rows(f.q[expert, r0:r1], f.ggml_type, torch.float32))


class GgufBlockExperts(QuantizedExperts):
    """A GGUF block type's experts. A subclass names its plan format and, for the dummy weights (random
    bytes are valid codes, the fp16 scales are then set), its blocks' fp16 scales: (byte offset into a block,
    value for weights of std 1) each (`scale_fields`)."""

    family_reader = GgufFamilyReader
    host_kernel_code = K.GGUF  # the block type is each family's (host_expert_kernel.py reads it from the views)
    scale_fields: tuple[tuple[int, float], ...] = ()

    @property
    def ggml_type(self) -> str:
        return self.plan.ggml_type

    def _write(self, row: torch.Tensor, layout: F.FamilyLayout, projections: tuple[GgufWeight, ...]) -> None:
        (q,) = (part(row, p) for p in layout.parts)
        first = 0
        for proj in projections:
            if proj.fmt != self.name:
                raise ValueError(
                    f"checkpoint tensor {proj.source!r} is {proj.fmt}, but the routed experts are {self.name}: "
                    "every expert must be"
                )
            rows = proj.q.shape[0]
            q[first : first + rows].copy_(proj.q)
            first += rows

    def _fill_dummy(self, rows: torch.Tensor, layout: F.FamilyLayout, std: float, gen: torch.Generator) -> None:
        (q,) = layout.parts
        experts, width = rows.shape[0], q.nbytes
        pattern = torch.randint(0, 256, (dummy_pattern(experts, width),), dtype=torch.uint8, generator=gen)
        blocks = raw(rows, q).copy_(expert_windows(pattern, experts, width)).view(experts, -1, self.plan.block_bytes)
        for offset, unit in self.scale_fields:
            scale = np.frombuffer(np.float16(std * unit).tobytes(), dtype=np.uint8)
            blocks[:, :, offset : offset + 2].copy_(torch.from_numpy(scale.copy()))
