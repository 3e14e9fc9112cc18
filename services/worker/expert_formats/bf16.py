"""The `bf16` expert format's worker side (plan/expert_formats/bf16.py prices it): experts in the run dtype
(bf16 on a GPU, float32 in the CPU tests), in slots w13 [S, 2I, H] (gate rows, then up rows) and
w2 [S, H, I], and in host banks of the same rows (offload/host_memory/host_banks.py). The expert kernels read the
slot tensors as they are (kernels/grouped_expert_gemm.py, kernels/expert_pair_gemv.py); the host kernel
reads the bank rows in float32 or bf16; `--load-format dummy` fills them from services/worker/dummy_weights.py.

What every worker format gives (the checklist: services/worker/expert_formats/__init__.py): `plan`,
`name`, `row_shapes`, `write_expert`, `gemm_views` (which pick the kernels), `host_kernel_format`,
`host_bias_offsets`, `host_reader`, `copy_engine_default`, `for_shapes`, and for byte rows `fill_dummy_layer`.

Experts with biases (gpt-oss: `epilogue` with `bias_rows`) keep them in rows after their weights, w13
[2I + b13, H] and w2 [H + b2, I] (plan/expert_formats/registry.py's `bias_rows`), so every copy of an
expert moves its biases; the kernels read them, with the activation, through kernels/expert_epilogue.py's
EpilogueFamily (the reference twin and the Triton expert kernels), and the host kernels read them in the bank rows
(`host_bias_offsets`, PlainReader)."""

from __future__ import annotations

import torch

from ferry.kernels.expert_epilogue import SILU_AND_MUL, EpilogueFamily, ExpertActivation
from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats.expert_shapes import ExpertBias, check_expert_shapes
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute.host_expert_weights import PlainReader
from ferry.services.worker.quantized_weight import QuantizedWeight

HOST_KERNEL_FORMATS = {torch.float32: K.F32, torch.bfloat16: K.BF16}  # the C kernel's bank dtypes


class Bf16Experts:
    plan = F.get(F.BF16)
    quantized = False
    copy_engine_default = True  # plain bf16 banks: --expert-copy-engine-tokens defaults on (services/worker/flags.py)
    views_per_layer = False

    def __init__(
        self,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        bias_rows: tuple[int, int] = (0, 0),
        activation: ExpertActivation = SILU_AND_MUL,
    ):
        self.hidden, self.inter, self.dtype = hidden, inter, dtype
        self.bias_rows, self.activation = bias_rows, activation
        self.name = self.plan.display_name(str(dtype).removeprefix("torch."))

    @classmethod
    def for_shapes(cls, hidden: int, inter: int, dtype: torch.dtype, epilogue=None) -> Bf16Experts:
        """`epilogue`: (bias_rows, ExpertActivation) of experts with biases or another activation, else None."""
        return cls(hidden, inter, dtype) if epilogue is None else cls(hidden, inter, dtype, *epilogue)

    @property
    def has_epilogue(self) -> bool:
        return self.bias_rows != (0, 0) or self.activation != SILU_AND_MUL

    def row_shapes(self):
        h, i = self.hidden, self.inter
        b13, b2 = self.bias_rows
        return ((2 * i + b13, h), self.dtype), ((h + b2, i), self.dtype)

    def write_expert(
        self, dst13: torch.Tensor, dst2: torch.Tensor, gate, up, down, where: str, bias: ExpertBias | None = None
    ) -> None:
        """`bias` where the rows hold biases (None there: zero biases, as --load-format dummy's)."""
        if any(isinstance(t, QuantizedWeight) for t in (gate, up, down)):
            raise ValueError(
                f"{where} is quantized in the checkpoint, but its config.json has no quantization_config "
                "that says so: use the checkpoint's own config.json (and hf_quant_config.json)"
            )
        check_expert_shapes(where, gate, up, down, self.inter, self.hidden)
        i, h = self.inter, self.hidden
        if bias is not None and self.bias_rows == (0, 0):
            raise ValueError(f"{where} has biases, but this model's experts have none (config.json)")
        dst13[:i].copy_(gate)
        dst13[i : 2 * i].copy_(up)
        dst2[:h].copy_(down)
        if self.bias_rows == (0, 0):
            return
        flat13, flat2 = dst13[2 * i :].reshape(-1), dst2[h:].reshape(-1)
        flat13.zero_()
        flat2.zero_()
        if bias is not None:
            for name, got, want in (("gate/up bias", bias.gate_up, 2 * i), ("down bias", bias.down, h)):
                if tuple(got.shape) != (want,):
                    raise ValueError(f"{where}: {name} has shape {tuple(got.shape)}, expected ({want},)")
            flat13[: 2 * i].copy_(bias.gate_up)
            flat2[:h].copy_(bias.down)

    def gemm_views(self, w13: torch.Tensor, w2: torch.Tensor, moe_layer: int | None = None):
        """The slot tensors as they are; with an epilogue, EpilogueFamily views of their weight and bias rows."""
        if not self.has_epilogue:
            return w13, w2
        i, h = self.inter, self.hidden
        b13, b2 = self.bias_rows
        bias13 = w13[:, 2 * i :].reshape(w13.shape[0], -1)[:, : 2 * i] if b13 else None
        bias2 = w2[:, h:].reshape(w2.shape[0], -1)[:, :h] if b2 else None
        return (
            EpilogueFamily(w13[:, : 2 * i], bias13, self.activation),
            EpilogueFamily(w2[:, :h], bias2),
        )

    def host_kernel_format(self) -> int:
        if self.dtype not in HOST_KERNEL_FORMATS:
            raise K.KernelUnavailable(f"banks of {self.name} experts have no C kernel")
        return HOST_KERNEL_FORMATS[self.dtype]

    def host_bias_offsets(self) -> tuple[int, int]:
        """(w13, w2): bytes from an expert's rows to its biases (the rows after its weights, in the bank dtype),
        K.NO_BIAS without them."""
        if self.bias_rows == (0, 0):
            return K.NO_BIAS, K.NO_BIAS
        size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.inter * self.hidden * size, self.hidden * self.inter * size

    def host_reader(self, banks, dtype: torch.dtype, chunk: int):
        """The bank's rows (a conversion, if any, is one copy a family), with their biases and activation."""
        return PlainReader(banks, dtype, self.bias_rows != (0, 0), self.activation)
