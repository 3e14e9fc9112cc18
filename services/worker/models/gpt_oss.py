"""gpt_oss's composition: paged softmax attention in every layer (q/k/v/o biases, a sink logit per head, a
sliding window in every other layer, YaRN rotary), plain RMSNorms, the MoE block with a biased router and
biased experts under the clamped SwiGLU. All of it is the shared layers' options, set by the spec; what is
gpt-oss's own is its checkpoint layout, converted here: the router is `mlp.router.` (Ferry's `mlp.gate.`),
and each layer's experts are stored fused and transposed, `gate_up_proj` [E, H, 2I] with gate and up
interleaved along the last axis (even: gate, odd: up), `gate_up_proj_bias` [E, 2I] likewise,
`down_proj` [E, I, H] and `down_proj_bias` [E, H]; Ferry's fused expert layout is [E, 2I, H] with the gate's
rows first, [E, H, I], and the biases in that order (models/weights.py). openai's mxfp4 release stores each
weight as `_blocks` [E, O, IN/32, 16] and `_scales` [E, O, IN/32], not transposed, gate/up's rows
interleaved: only those rows are reordered here. Its config reader: plan/model_families/gpt_oss.py."""

from __future__ import annotations

import torch
from torch import nn

from ferry.plan.model_config import ModelSpec
from ferry.plan.model_families.gpt_oss import CHECKPOINT_ROUTER, ROUTER, checkpoint_name
from ferry.services.worker.layers.attention import PagedAttention
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.services.worker.models.decoder import DecoderFamily, Tensors
from ferry.services.worker.models.registry import register


def gate_then_up(interleaved: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up interleaved (gate at even positions) -> [..., 2I] the gate's I then the up's."""
    return torch.cat([interleaved[..., 0::2], interleaved[..., 1::2]], dim=-1)


def interleaved(gate_then_up: torch.Tensor) -> torch.Tensor:
    """`gate_then_up` inverted: [..., 2I] the gate's I then the up's -> gate and up interleaved."""
    gate, up = gate_then_up.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


class GptOss(DecoderFamily):
    def mixer(
        self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, dtype: torch.dtype, device
    ) -> tuple[str, nn.Module]:
        return "self_attn", PagedAttention(spec, layer, rotary, dtype, device)

    def checkpoint_tensors(self, spec: ModelSpec, name: str, tensor: torch.Tensor, source: str) -> Tensors:
        if name.endswith((".mlp.experts.gate_up_proj_blocks", ".mlp.experts.gate_up_proj_scales")):
            # mxfp4 (openai's release): [E, 2I, ...] untransposed, the gate's and the up's rows interleaved
            return ((name, torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)),)
        if name.endswith(".mlp.experts.gate_up_proj"):
            return ((name, gate_then_up(tensor).transpose(1, 2)),)  # [E, H, 2I] -> [E, 2I, H]
        if name.endswith(".mlp.experts.gate_up_proj_bias"):
            return ((name, gate_then_up(tensor)),)
        if name.endswith(".mlp.experts.down_proj"):
            return ((name, tensor.transpose(1, 2)),)  # [E, I, H] -> [E, H, I]
        return ((name.replace(CHECKPOINT_ROUTER, ROUTER), tensor),)

    def checkpoint_names(self, spec: ModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        return {checkpoint_name(name): shape for name, shape in shapes.items()}

    def fused_expert_tensors(self, spec, prefix, gate_up, down, bias) -> dict[str, torch.Tensor]:
        """`checkpoint_tensors`' expert conversions inverted: gpt-oss's published (and transformers') layout."""
        tensors = {
            f"{prefix}.gate_up_proj": interleaved(gate_up.transpose(1, 2)).contiguous(),  # [E, H, 2I]
            f"{prefix}.down_proj": down.transpose(1, 2).contiguous(),  # [E, I, H]
        }
        if bias is not None:
            tensors[f"{prefix}.gate_up_proj_bias"] = interleaved(bias[0]).contiguous()
            tensors[f"{prefix}.down_proj_bias"] = bias[1]
        return tensors

    def fused_quantized_expert_tensors(self, spec, prefix, leaves, bias) -> dict[str, torch.Tensor]:
        """openai's release: per layer `experts.gate_up_proj_blocks` [E, 2I, H/32, 16] and `_scales` [E, 2I, H/32]
        untransposed, the gate's and the up's rows interleaved, `down_proj_blocks` / `_scales` [E, H, ...] (a
        linear's `weight_blocks` published as `_blocks`), and the biases as `fused_expert_tensors` stores them."""
        tensors = {}
        for leaf, (gate_up, down) in leaves.items():
            suffix = leaf.removeprefix("weight")
            gate, up = gate_up.chunk(2, dim=1)
            tensors[f"{prefix}.gate_up_proj{suffix}"] = torch.stack([gate, up], dim=2).flatten(1, 2).contiguous()
            tensors[f"{prefix}.down_proj{suffix}"] = down.contiguous()
        if bias is not None:
            tensors[f"{prefix}.gate_up_proj_bias"] = interleaved(bias[0]).contiguous()
            tensors[f"{prefix}.down_proj_bias"] = bias[1]
        return tensors


register(GptOss("gpt_oss"))
