"""Tiny random transformers models of each served architecture, and their ModelSpec.

Weights are re-drawn at scales that make logits O(1) and routing decisive: transformers' own
init (std 0.02, zero-centred norms at 0) gives near-uniform logits whose greedy argmax would
hinge on rounding, and would leave (1 + w) norms untested."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import (
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from ferry.plan.model_config import ModelSpec, parse_model_config

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    max_position_embeddings=512,
    rope_theta=10000.0,
)
LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    shared_expert_intermediate_size=24,
)

GLM = dict(
    n_shared_experts=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    attention_bias=True,
    partial_rotary_factor=0.5,
    norm_topk_prob=True,
)

# gpt_oss: a window shorter than the tests' prompts, and a SwiGLU limit the tiny model's projections reach
# (at 7.0 the clamp would never bite)
GPT_OSS = dict(sliding_window=8, swiglu_limit=1.0)

# gemma4: two sliding layers (a window shorter than the prompts) then a full one with twice the head size, one
# KV head shared by K and V, proportional rotary on a quarter of its pairs; logits soft-capped near their scale
GEMMA4 = dict(
    num_hidden_layers=3,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    intermediate_size=48,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=8,
    enable_moe_block=True,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=3.0,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    },
)


def _config(arch: str, **overrides):
    fields = dict(COMMON, **overrides)
    if arch == "qwen3_moe":
        fields.setdefault("num_hidden_layers", 2)
        fields.setdefault("intermediate_size", 48)
        return Qwen3MoeConfig(**fields), Qwen3MoeForCausalLM
    if arch == "glm4_moe":
        fields["n_routed_experts"] = fields.pop("num_experts")
        fields.setdefault("num_hidden_layers", 3)
        fields.setdefault("intermediate_size", 48)
        # every way its router and attention differ from qwen3_moe's: groups, a dense first layer, biases
        for name, value in GLM.items():
            fields.setdefault(name, value)
        return Glm4MoeConfig(**fields), Glm4MoeForCausalLM
    if arch == "gpt_oss":
        fields["num_local_experts"] = fields.pop("num_experts")
        fields["intermediate_size"] = fields.pop("moe_intermediate_size")
        fields.setdefault("num_hidden_layers", 2)
        for name, value in GPT_OSS.items():
            fields.setdefault(name, value)
        return GptOssConfig(**fields), GptOssForCausalLM
    if arch == "gemma4":
        fields.pop("rope_theta")  # rope_parameters, per layer type
        fields["top_k_experts"] = fields.pop("num_experts_per_tok")
        for name, value in GEMMA4.items():
            fields.setdefault(name, value)
        return Gemma4TextConfig(**fields), Gemma4ForCausalLM
    fields = dict(LINEAR, **fields)
    fields.setdefault("num_hidden_layers", 3)
    default_types = ["linear_attention", "full_attention", "linear_attention"]
    fields.setdefault("layer_types", default_types[: fields["num_hidden_layers"]])
    if arch == "qwen3_next":
        fields.setdefault("intermediate_size", 48)
        return Qwen3NextConfig(**fields), Qwen3NextForCausalLM
    if arch == "qwen3_5_moe":
        fields.pop("norm_topk_prob", None)  # qwen3_5_moe always renormalises
        return Qwen3_5MoeTextConfig(**fields), Qwen3_5MoeForCausalLM
    raise ValueError(arch)


def swiglu_from_config(model: torch.nn.Module) -> None:
    """gpt_oss's experts clamp and gain by the config's `swiglu_limit` / `swiglu_alpha`, as the published configs
        say: transformers before 5.18 fixed them at 7.0 and 1.702 whatever the config said, so the reference the
        device's older transformers computed was another model than the tiny config's (its limit of 1.0). Their
    defaults where the config has none (older configs keep only the fields passed)."""
    limit, alpha = getattr(model.config, "swiglu_limit", 7.0), getattr(model.config, "swiglu_alpha", 1.702)
    for module in model.modules():
        if hasattr(module, "limit") and hasattr(module, "alpha"):
            module.limit, module.alpha = limit, alpha


@torch.no_grad()
def _redraw(model: torch.nn.Module, generator: torch.Generator) -> None:
    embed_scaled = getattr(model.config, "model_type", "") in ("gemma4", "gemma4_text")
    buffers = [(n, b) for n, b in model.named_buffers() if n.endswith(("e_score_correction_bias", "layer_scalar"))]
    for name, p in [*model.named_parameters(), *buffers]:
        noise = torch.randn(p.shape, generator=generator)
        if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight")):
            p.add_(0.2 * noise)  # around 1 (plain) or 0 (zero-centred), whichever the module uses
        elif name.endswith(("router.scale", "per_expert_scale", "layer_scalar")):  # Gemma 4's, around 1
            p.copy_(1.0 + 0.3 * noise)
        elif name.endswith("router.proj.weight"):  # Gemma 4's router normalises its input: logits of O(1)
            p.copy_(2.0 * noise)
        elif name.endswith("dt_bias"):
            p.copy_(1.0 + 0.5 * noise)
        elif name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.1, 3.0, generator=generator).log())
        elif name.endswith(".sinks"):
            p.copy_(noise)  # a sink worth a key's share of the softmax, so dropping it shows
        elif name.endswith("e_score_correction_bias"):
            # a spread wider than the scores' differences: choosing with the bias picks other experts
            p.copy_(0.3 * noise)
        elif name.endswith("embed_tokens.weight"):
            # O(1) after the embedding multiplier (Gemma's sqrt(hidden)): tied to the head, larger rows would make
            # every token predict itself
            p.copy_(noise / getattr(model.config, "hidden_size", 1) ** 0.5 if embed_scaled else noise)
        elif p.dim() >= 2:
            fan_in = p.shape[-1]  # [out, in], fused experts [E, out, in], conv [C, 1, kernel]
            gain = 2.0 if name.endswith("gate.weight") and "shared" not in name else 1.0
            p.copy_(gain * noise / math.sqrt(fan_in))
        else:
            p.copy_(0.1 * noise)


def tiny_model(arch: str, seed: int = 0, **overrides) -> tuple[torch.nn.Module, ModelSpec]:
    """(transformers model in float32, eval mode; the ModelSpec parsed from its config.json dict)."""
    config, cls = _config(arch, **overrides)
    torch.manual_seed(seed)
    model = cls(config).eval()
    if arch == "gpt_oss":
        swiglu_from_config(model)
    _redraw(model, torch.Generator().manual_seed(seed))
    spec = parse_model_config(config.to_dict(), where=f"tiny {arch}")
    return model, spec


def redrawn_tiny_checkpoint(directory: Path, arch: str, **sizes) -> Path:
    """`ferry make-tiny-model --arch ARCH` in `directory` (with `sizes`' config fields), its weights redrawn as
    `tiny_model` draws them (biases, sinks and score biases nonzero, so a path dropping one shows) and saved back
    by transformers in its layout."""
    from transformers import AutoModelForCausalLM

    from ferry.services.make_tiny_model import make_tiny_model

    out = make_tiny_model(directory / arch, arch, seed=0, **sizes)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    _redraw(model, torch.Generator().manual_seed(5))
    model.save_pretrained(out, safe_serialization=True)
    return out
