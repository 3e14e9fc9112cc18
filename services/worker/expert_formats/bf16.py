"""The `bf16` expert format's worker side (plan/expert_formats/bf16.py prices it): experts in the run dtype
(bf16 on a GPU, float32 in the CPU tests), in slots w13 [S, 2I, H] (gate rows, then up rows) and
w2 [S, H, I], and in host banks of the same rows (offload/host_memory/host_banks.py). The expert kernels read the
slot tensors as they are (kernels/grouped_expert_gemm.py, kernels/expert_pair_gemv.py); the host kernel
reads the bank rows in float32 or bf16; `--load-format dummy` fills them from services/worker/dummy_weights.py.

What every worker format gives (the checklist: services/worker/expert_formats/__init__.py): `plan`,
`name`, `row_shapes`, `write_expert`, `gemm_views` (which pick the kernels), `host_kernel_format`,
`host_reader`, `copy_engine_default`, `for_shapes`, and for byte rows `fill_dummy_layer`."""

from __future__ import annotations

import torch

from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats.expert_shapes import check_expert_shapes
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute.host_expert_weights import PlainReader
from ferry.services.worker.quantized_weight import QuantizedWeight

HOST_KERNEL_FORMATS = {torch.float32: K.F32, torch.bfloat16: K.BF16}  # the C kernel's bank dtypes


class Bf16Experts:
    plan = F.get(F.BF16)
    quantized = False
    copy_engine_default = True  # plain bf16 banks: --expert-copy-engine-tokens defaults on (services/worker/flags.py)

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        self.hidden, self.inter, self.dtype = hidden, inter, dtype
        self.name = self.plan.display_name(str(dtype).removeprefix("torch."))

    @classmethod
    def for_shapes(cls, hidden: int, inter: int, dtype: torch.dtype) -> Bf16Experts:
        return cls(hidden, inter, dtype)

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

    def host_kernel_format(self) -> int:
        if self.dtype not in HOST_KERNEL_FORMATS:
            raise K.KernelUnavailable(f"banks of {self.name} experts have no C kernel")
        return HOST_KERNEL_FORMATS[self.dtype]

    def host_reader(self, banks, dtype: torch.dtype, chunk: int):
        return PlainReader(banks, dtype)  # a conversion, if any, is one copy a family
