"""gemma4's composition (Gemma 4 MoE): paged softmax attention in every layer, its sliding and full layers
each with their own head size, KV heads and rotary embedding (the spec's per-layer fields: layers/attention.py,
layers/rotary.py), and in every layer a gelu dense MLP beside the routed experts. Its layer is its own:

    x = x + post_attention_norm(attention(input_norm(x)))
    dense = post_feedforward_norm_1(mlp(pre_feedforward_norm(x)))
    routed = post_feedforward_norm_2(experts(pre_feedforward_norm_2(x), router(x)))
    x = (x + post_feedforward_norm(dense + routed)) * layer_scalar

as transformers' Gemma4TextDecoderLayer. The router RMS-normalises x without a weight, multiplies it by its
`scale` and hidden ** -0.5, softmaxes the logits over all experts, keeps and renormalises the top k (the
softmax router's kernel and twin) and multiplies each weight by its expert's `per_expert_scale`. The
embeddings' scale and the logits' soft cap are the decoder's (models/decoder.py, by the spec). The experts
sit at `layers.N.experts.` beside the dense `layers.N.mlp.` (models/weights.py reads both places). Its norms
are the shared plain RMSNorm, which multiplies the weight into the normalised input rounded to the dtype where
transformers' Gemma4RMSNorm multiplies in float32: equal in float32, a rounding apart in bf16 (its bf16 logits
stay as far from the float32 ones as transformers' own: tests/gpu/test_models_cuda.py). Its config reader:
plan/model_families/gemma4.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferry.kernels.dispatch import use_triton
from ferry.kernels.rms_norm_reference import rms_normalise
from ferry.kernels.router_topk import router_topk_triton
from ferry.kernels.router_topk_reference import router_topk_reference
from ferry.plan.model_config import ModelSpec
from ferry.plan.model_families.gemma4 import LAYER_NORMS
from ferry.services.worker.layers.attention import PagedAttention
from ferry.services.worker.layers.context import StepContext
from ferry.services.worker.layers.mlp import DenseMLP
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.services.worker.models.decoder import DecoderFamily
from ferry.services.worker.models.registry import register
from ferry.services.worker.offload.stores.expert_store import ExpertStore


class Gemma4Router(nn.Module):
    """(ids [T, k], weights [T, k] in x's dtype) of the experts a layer's input x routes to."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device=None):
        super().__init__()
        h, e = spec.hidden_size, spec.num_experts
        self.eps, self.top_k, self.num_experts, self.root = spec.rms_norm_eps, spec.num_experts_per_tok, e, h**-0.5
        self.proj = nn.Linear(h, e, bias=False, dtype=dtype, device=device)
        self.proj.weight.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(e, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = rms_normalise(x, self.eps).to(x.dtype) * self.scale * self.root
        logits = F.linear(scaled, self.proj.weight)
        route = router_topk_triton if use_triton(x) else router_topk_reference
        ids, weights, _ = route(logits, self.top_k, True, self.num_experts)
        return ids, (weights.float() * self.per_expert_scale[ids].float()).to(x.dtype)


class Gemma4Layer(nn.Module):
    """One Gemma 4 layer (the module docstring's sums). Its input is the whole residual stream, and so is its
    output: `forward` returns (hidden, None), no residual add left to the next norm (its layer_scalar scales the
    sum, which a fused add-and-norm would not)."""

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        rotary: RotaryEmbedding,
        experts: ExpertStore,
        dtype: torch.dtype,
        device,
        norm,
    ):
        super().__init__()
        self.layer_idx = layer
        self.self_attn = PagedAttention(spec, layer, rotary, dtype, device)
        self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, dtype, device, activation=spec.mlp_activation)
        self.router = Gemma4Router(spec, dtype, device)
        object.__setattr__(self, "experts", experts)  # not a submodule: the store's slots are not parameters
        self.moe_layer = spec.moe_layer_indices.index(layer)
        for name in LAYER_NORMS:
            setattr(self, name, norm(spec, spec.hidden_size, dtype, device))
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext) -> tuple[torch.Tensor, None]:
        if residual is not None:  # only the decoder's first call has none, and this layer leaves none
            raise ValueError("a Gemma 4 layer takes the whole residual stream")
        x = x + self.post_attention_layernorm(ctx.mix(self.self_attn, self.input_layernorm(x), self.layer_idx))
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(x)))
        ids, weights = self.router(x)
        routed = self.experts.forward(
            self.moe_layer, self.pre_feedforward_layernorm_2(x), ids, weights, n_rows=ctx.batch.real_tokens
        )
        x = x + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(routed))
        return x * self.layer_scalar, None


def _rope_keys(spec: ModelSpec) -> list[tuple]:
    """Per layer what its rotary embedding depends on: its head size and LayerRope."""
    return [(spec.layer_head_dim(i), spec.layer_ropes[i]) for i in range(spec.num_layers)]


class Gemma4(DecoderFamily):
    def rotaries(self, spec: ModelSpec, device) -> list[RotaryEmbedding]:
        distinct = list(dict.fromkeys(_rope_keys(spec)))
        return [
            RotaryEmbedding(head_dim, rope.partial_rotary_factor, rope.theta, device, proportional=rope.proportional)
            for head_dim, rope in distinct
        ]

    def rotary_of(self, spec: ModelSpec, layer: int) -> int:
        keys = _rope_keys(spec)
        return list(dict.fromkeys(keys)).index(keys[layer])

    def mixer(
        self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, dtype: torch.dtype, device
    ) -> tuple[str, nn.Module]:
        return "self_attn", PagedAttention(spec, layer, rotary, dtype, device)

    def layer(
        self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, experts: ExpertStore, dtype: torch.dtype, device
    ) -> Gemma4Layer:
        return Gemma4Layer(spec, layer, rotary, experts, dtype, device, self.norm)

    def fused_expert_tensors(self, spec, prefix, gate_up, down, bias) -> dict[str, torch.Tensor]:
        """transformers' Gemma4 layout: the layer's experts beside its MLP, `layers.N.experts.…` (no biases)."""
        prefix = prefix.replace(".mlp.experts", ".experts")
        return {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}


register(Gemma4("gemma4"))
