"""glm4_moe's composition: paged full attention in every layer (q/k/v biases, q/k norms only where the spec
says, partial half-split rotary), plain RMSNorms, dense MLPs in the first layers and then the MoE block with
the sigmoid router and an ungated shared expert. All of it is the shared layers' options, set by the spec;
what is GLM's own is the shared expert's checkpoint name, `mlp.shared_experts.` for the block's
`mlp.shared_expert.`. Its config reader (and why the MTP layers are skipped): plan/model_families/glm4_moe.py."""

from __future__ import annotations

import torch
from torch import nn

from ferry.plan.model_config import ModelSpec
from ferry.plan.model_families.glm4_moe import SHARED_EXPERT, SHARED_EXPERTS, checkpoint_name
from ferry.services.worker.layers.attention import PagedAttention
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.services.worker.models.decoder import DecoderFamily, Tensors
from ferry.services.worker.models.registry import register


class Glm4Moe(DecoderFamily):
    def mixer(
        self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, dtype: torch.dtype, device
    ) -> tuple[str, nn.Module]:
        return "self_attn", PagedAttention(spec, layer, rotary, dtype, device)

    def checkpoint_tensors(self, spec: ModelSpec, name: str, tensor: torch.Tensor, source: str) -> Tensors:
        return ((name.replace(SHARED_EXPERTS, SHARED_EXPERT), tensor),)

    def checkpoint_names(self, spec: ModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return {checkpoint_name(name): shape for name, shape in shapes.items()}


register(Glm4Moe("glm4_moe"))
