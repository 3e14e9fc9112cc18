"""The `bf16-packed` expert format's worker side (plan/expert_formats/bf16_packed.py prices it, and says
why it is a format of its own): bf16 slots, exactly bf16's (this class is Bf16Experts for them), behind
host banks that keep every value in 12 bits (offload/host_memory/packed_banks.py, whose banks hold this format):
the host kernel decodes those banks itself (its PACKED code), the host reader unpacks them
(offload/host_compute/host_expert_weights.py's PackedReader), and misses take no copy-engine threshold by default
(the GPU's unpacking copy moves more bf16 bytes a second than the copy engine).

What it gives beyond Bf16Experts is what a bank variant must (the checklist:
services/worker/expert_formats/__init__.py): its `plan`, `host_kernel_format`, `host_reader` and
`copy_engine_default`; the bank class that holds it says so (`PackedHostBanks.holds`)."""

from __future__ import annotations

import torch

from ferry.kernels.expert_epilogue import SILU_AND_MUL, ExpertActivation
from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats.bf16 import Bf16Experts
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute.host_expert_weights import PackedReader


class Bf16PackedExperts(Bf16Experts):
    plan = F.get(F.BF16_PACKED)
    copy_engine_default = False

    def __init__(
        self,
        hidden: int,
        inter: int,
        dtype: torch.dtype = torch.bfloat16,
        bias_rows: tuple[int, int] = (0, 0),
        activation: ExpertActivation = SILU_AND_MUL,
    ):
        """`activation`: the experts' (gelu_tanh for Gemma's), which the host kernel and reader compute; packed
        banks hold no biases (the plan keeps experts with biases in plain banks)."""
        if dtype != torch.bfloat16:
            raise ValueError(f"packed expert banks hold bf16 experts, not {dtype}")
        if bias_rows != (0, 0):
            raise ValueError("packed expert banks hold experts without biases: keep these in plain banks")
        super().__init__(hidden, inter, dtype, activation=activation)

    def host_kernel_format(self) -> int:
        return K.PACKED

    def host_reader(self, banks, dtype: torch.dtype, chunk: int):
        return PackedReader(banks, dtype, chunk)
