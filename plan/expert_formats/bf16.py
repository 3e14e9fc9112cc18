"""The `bf16` expert format: the routed experts unquantized, in the run dtype (bf16 on a GPU, float32
in the CPU tests), slots w13 [S, 2I, H] (gate rows, then up rows) and w2 [S, H, I], host banks of the
same rows; experts with biases (gpt-oss) have them in rows appended to each (`bias_rows`). The format of
every checkpoint that does not quantize its routed experts, so it registers first (registry.unquantized).
Worker side: services/worker/expert_formats/bf16.py.

It registers what every format must (the checklist: plan/expert_formats/__init__.py): its name,
its slot rows and their bytes, its plan words (`display_name`, `banks_detail`), its make-bench-model
layout and its worker class; its banks are the default `plain` ones."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.plan.expert_formats.registry import ExpertFormat, register

if TYPE_CHECKING:
    from ferry.plan.model_spec import ModelSpec

BF16 = "bf16"


class Bf16(ExpertFormat):
    name = BF16
    checkpoint_layout = BF16  # make-bench-model --format bf16: nothing quantized
    worker = "ferry.services.worker.expert_formats.bf16:Bf16Experts"

    holds_biases = True  # in rows after the weights' (bias_rows)

    def slot_rows(self, spec: ModelSpec, dtype: str):
        h, i = spec.hidden_size, spec.moe_intermediate_size
        b13, b2 = self.bias_rows(spec)
        return ((2 * i + b13, h), dtype), ((h + b2, i), dtype)

    def slot_family_bytes(self, spec: ModelSpec, value_bytes: int) -> tuple[int, int]:
        h, i = spec.hidden_size, spec.moe_intermediate_size
        b13, b2 = self.bias_rows(spec)
        return (2 * i + b13) * h * value_bytes, (h + b2) * i * value_bytes

    def display_name(self, dtype: str) -> str:
        """`bf16` in bfloat16; in another run dtype that dtype's name (`float32` on CPU)."""
        return self.name if dtype == "bfloat16" else dtype

    def banks_detail(self, experts: int, bytes_per_slot: int) -> str:
        return f"every routed expert pinned in host RAM ({experts} x {bytes_per_slot} B)"


FORMAT = register(Bf16())
