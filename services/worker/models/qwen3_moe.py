"""qwen3_moe's composition: paged full attention in every layer, plain RMSNorms (q/k norms too), the MoE
block without a shared expert (dense MLPs where the spec says); checkpoint names are the module tree's.
Its config reader: plan/model_families/qwen3_moe.py."""

from __future__ import annotations

import torch
from torch import nn

from ferry.plan.model_config import ModelSpec
from ferry.services.worker.layers.attention import PagedAttention
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.services.worker.models.decoder import DecoderFamily
from ferry.services.worker.models.registry import register


class Qwen3Moe(DecoderFamily):
    def mixer(
        self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, dtype: torch.dtype, device
    ) -> tuple[str, nn.Module]:
        return "self_attn", PagedAttention(spec, layer, rotary, dtype, device)


register(Qwen3Moe("qwen3_moe"))
