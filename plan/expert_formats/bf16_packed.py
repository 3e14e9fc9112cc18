"""The `bf16-packed` expert format: bf16 experts whose host banks keep every value losslessly in 12 bits
(kernels/expert_pack.py: a quarter fewer bytes in host RAM and on PCIe), unpacked as the copies land
in bf16 slots. It registers as a format of its own rather than as a flag of bf16 because everything a
format registers differs (bank bytes, the bank class, the host kernel's decode, the plan's words)
except the slots, which it names through `slots_format`. --expert-bank-format's `packed` picks it;
`auto` does for bf16 models. Worker side: services/worker/expert_formats/bf16_packed.py (its banks:
services/worker/offload/host_memory/packed_banks.py).

It registers what every format must (the checklist: plan/expert_formats/__init__.py): its name and
worker class, and as a bank variant its slots' format, its bank word and bytes, when auto picks it
(`auto_for`), the run dtypes it refuses (`check_run_dtype`) and its plan words."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.plan.expert_formats.bf16 import BF16
from ferry.plan.expert_formats.registry import PLAIN_BANKS, ExpertFormat, register

if TYPE_CHECKING:
    from ferry.plan.model_spec import ModelSpec

BF16_PACKED = "bf16-packed"
PACKED_BANKS = "packed"  # its --expert-bank-format word
# A packed expert's values outside its exponent window are kept whole, 6 bytes each (int32 position,
# int16 bits). Normal and trained weights have about 1e-4 of them; the plan sets aside room for
# 1/512 of the values (0.8% of the packed bytes), and the banks check what they really hold.
PACKED_ESCAPE_BYTES = 6
PACKED_ESCAPE_SHARE = 512


def packed_expert_bytes(values: int) -> int:
    """One packed expert of `values` values (3 I H) without its escapes: a byte (sign, mantissa)
    and half a byte (exponent code) per value, and two int32 exponent bases (one per family)."""
    return values + values // 2 + 2 * 4


def packed_escape_allowance(values: int) -> int:
    """The escaped values the plan prices for one packed expert of `values` values."""
    return values // PACKED_ESCAPE_SHARE


def packed_bank_bytes(num_layers: int, num_experts: int, values: int) -> int:
    """Packed banks of experts of `values` values: the fixed part, the escape allowance, and each
    layer's escape offsets (int64, one per expert and one more)."""
    allowance = packed_escape_allowance(values) * PACKED_ESCAPE_BYTES
    return num_layers * (num_experts * (packed_expert_bytes(values) + allowance) + (num_experts + 1) * 8)


class Bf16Packed(ExpertFormat):
    name = BF16_PACKED
    slots_format = BF16
    bank_word = PACKED_BANKS
    banks_keep = "bf16 experts"
    worker = "ferry.services.worker.expert_formats.bf16_packed:Bf16PackedExperts"

    def bank_bytes(self, spec: ModelSpec, value_bytes: int) -> int:
        values = 3 * spec.moe_intermediate_size * spec.hidden_size
        return packed_bank_bytes(len(spec.moe_layer_indices), spec.num_experts, values)

    def auto_for(self, dtype: str) -> bool:
        """--expert-bank-format auto packs bf16 models (the only dtype it holds)."""
        return dtype == "bfloat16"

    def check_run_dtype(self, dtype: str) -> None:
        if dtype != "bfloat16":
            raise ValueError(
                f"--expert-bank-format {self.bank_word} keeps bf16 experts; this model runs in {dtype}: "
                f"use --expert-bank-format {PLAIN_BANKS} (or auto), or --dtype bfloat16"
            )

    def banks_detail(self, experts: int, bytes_per_slot: int) -> str:
        return (
            f"every routed expert pinned in host RAM, packed to 12 bits a value ({experts} x "
            f"{bytes_per_slot} B as bf16; with room for escapes)"
        )


FORMAT = register(Bf16Packed())
