"""The `gguf-mixed` expert format: a GGUF file whose routed experts mix ggml block types by layer and family, as
llama.cpp's `_M` mixes do (Q4_K_M: ffn_gate_exps / ffn_up_exps Q4_K everywhere, ffn_down_exps Q6_K on some layers
and Q4_K on the others), every layer's rows kept as the file stores them, in that layer's types.

Per MoE layer one type for w13 (gate and up are one byte row, so they must agree: plan/gguf_checkpoint.py refuses
a file where they do not) and one for w2, listed by quantization_config's `expert_types`
([[w13 type, w2 type] per MoE layer]) and each held by its one-type format (gguf_q4_k.py, ...), which prices that
layer's rows. The slot pool is shared by all layers, so a family's slot row is the largest of its layers' rows and
a layer of a smaller type uses the row's prefix (`row_padding_bytes` prices what that leaves unused); the host
banks are laid out as the slots, one row size for every layer, so they pay the same padding. A decode's copies
(the GPU's own, kernels/expert_copy.py) move only the prefix a layer fills; the copy engine's (prefill and large
steps) move whole rows, and the cache's bytes_copied counts whole rows.
Worker side: services/worker/expert_formats/gguf_mixed.py (each layer's views in its own types)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING

from ferry.plan.expert_formats.gguf_blocks import GGUF_METHOD, GgufBlockFormat
from ferry.plan.expert_formats.registry import ExpertFormat, FamilyLayout, for_checkpoint, register

if TYPE_CHECKING:
    from ferry.plan.model_spec import ModelSpec

GGUF_MIXED = "gguf-mixed"
MIXED_TYPES = "mixed"  # quantization_config's ggml_type for such a file; its `expert_types` lists the layers'
FAMILIES = ("w13", "w2")


class GgufMixed(ExpertFormat):
    name = GGUF_MIXED
    quantized = True
    checkpoint_algos = ((GGUF_METHOD, MIXED_TYPES),)
    cuda_kernels = False  # a file's own types decide (`reads_on_cuda`)
    worker = "ferry.services.worker.expert_formats.gguf_mixed:GgufMixedExperts"

    def type_format(self, ggml_type: str) -> GgufBlockFormat:
        """The one-type format holding rows of `ggml_type`; a ValueError for a type no GGUF block format holds."""
        fmt = for_checkpoint(GGUF_METHOD, ggml_type)
        if not isinstance(fmt, GgufBlockFormat):
            raise ValueError(f"{self.name}: the experts' ggml type {ggml_type!r} is held by no GGUF block format")
        return fmt

    def reads_on_cuda(self, spec: ModelSpec) -> bool:
        """Every type of the file's layers has CUDA kernels (`cuda_kernels` of its one-type format)."""
        return all(self.type_format(t).cuda_kernels for pair in self.layer_types(spec) for t in pair)

    def layer_types(self, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
        """(w13's ggml type, w2's) of each MoE layer (quantization_config's expert_types); a ValueError unless one
        pair a MoE layer."""
        types = spec.quantization.expert_types if spec.quantization is not None else ()
        if len(types) != len(spec.moe_layer_indices):
            raise ValueError(
                f"{self.name} experts need quantization_config expert_types: one [w13 type, w2 type] per MoE layer "
                f"({len(spec.moe_layer_indices)}), got {len(types)}"
            )
        return types

    def layer_layouts(self, spec: ModelSpec) -> tuple[tuple[FamilyLayout, FamilyLayout], ...]:
        """(w13, w2) rows of one expert of each MoE layer, in that layer's types."""
        h, i = spec.hidden_size, spec.moe_intermediate_size
        return tuple(
            (self.type_format(t13).family_layout(2 * i, h, i), self.type_format(t2).family_layout(h, i, h))
            for t13, t2 in self.layer_types(spec)
        )

    def expert_layouts(self, spec: ModelSpec) -> tuple[FamilyLayout, FamilyLayout]:
        """Each family's largest row over the layers: what a slot (and a bank row) holds."""
        layers = self.layer_layouts(spec)
        return tuple(
            replace(max((layer[f] for layer in layers), key=lambda layout: layout.nbytes), fmt=self.name)
            for f in range(len(FAMILIES))
        )

    def row_types(self, spec: ModelSpec) -> dict[str, dict[str, int]]:
        types = self.layer_types(spec)
        return {family: dict(Counter(pair[f] for pair in types)) for f, family in enumerate(FAMILIES)}

    def row_padding_bytes(self, spec: ModelSpec) -> int:
        slot = sum(layout.nbytes for layout in self.expert_layouts(spec))
        used = sum(w13.nbytes + w2.nbytes for w13, w2 in self.layer_layouts(spec))
        return spec.num_experts * (slot * len(spec.moe_layer_indices) - used)

    def worker_options(self, spec: ModelSpec) -> dict:
        return {"layer_types": self.layer_types(spec)}

    def banks_detail(self, experts: int, bytes_per_slot: int) -> str:
        return (
            f"every routed expert pinned in host RAM as the GGUF file's blocks, each layer's in its own types, "
            f"in rows sized as the slots' ({experts} x {bytes_per_slot} B: the row padding included)"
        )


FORMAT = register(GgufMixed())
