"""qwen3_next (Qwen3-Next-80B-A3B) and qwen3_5_moe (Qwen3.5/3.6 MoE, text tower): the Qwen3 hybrids.

One module for both because they are one composition: Gated DeltaNet linear attention in most layers, gated
full attention (q_proj also yields a sigmoid gate; a quarter of each head rotated by default) in every
`full_attention_interval`-th, a MoE block with a shared expert, zero-centred RMSNorms. They differ in where
the config and the tensors sit, not in what is computed:
  * qwen3_5_moe checkpoints ship a multimodal wrapper (model_type `qwen3_5_moe`) whose `text_config` holds
    the text model (transformers also writes it flat as `qwen3_5_moe_text`), and name its tensors
    `model.language_model.…`; every layer is MoE and the router always renormalises (no flag in its config);
  * qwen3_next stores the Gated DeltaNet's input projection as two per-key-head interleaved tensors
    (`in_proj_qkvz`, `in_proj_ba`) where qwen3_5_moe has four (`in_proj_qkv`, `_z`, `_b`, `_a`), and
    `mlp_only_layers` / `decoder_sparse_step` may make layers dense.
The worker's half: services/worker/models/qwen3_hybrid.py."""

from __future__ import annotations

from typing import Any

from ferry.plan.model_families import ModelFamily, register
from ferry.plan.model_families.spec_fields import (
    attention_fields,
    gated_deltanet_fields,
    hybrid_layer_types,
    mlp_fields,
    num_experts,
    sparse_step_moe_layers,
)
from ferry.plan.model_families.weight_shapes import (
    attention_shapes,
    decoder_shapes,
    gated_deltanet_shapes,
    gated_deltanet_with,
)
from ferry.plan.model_spec import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec
from ferry.shared.errors import ConfigError

WRAPPER_MODEL_TYPE = "qwen3_5_moe"  # qwen3_5_moe's multimodal wrapper; its text model is `qwen3_5_moe_text`


def _hybrid_fields(cfg: dict[str, Any], where: str, moe_layers: tuple[bool, ...]) -> dict[str, Any]:
    return dict(
        layer_types=hybrid_layer_types(cfg, int(cfg["num_hidden_layers"]), where),
        moe_layers=moe_layers,
        zero_centered_norms=True,
        **attention_fields(cfg, where, partial_rotary_factor=0.25, output_gate=True),
        **mlp_fields(cfg, norm_topk_prob=True, shared_expert=True),
        **gated_deltanet_fields(cfg),
    )


def qwen3_next_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    return _hybrid_fields(cfg, where, sparse_step_moe_layers(cfg, int(cfg["num_hidden_layers"])))


def qwen3_5_moe_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    return _hybrid_fields(cfg, where, (num_experts(cfg) > 0,) * int(cfg["num_hidden_layers"]))


def qwen3_5_moe_text_config(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The wrapper's `text_config` (the flat `qwen3_5_moe_text` config as it is)."""
    if raw.get("model_type") != WRAPPER_MODEL_TYPE:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: model_type {WRAPPER_MODEL_TYPE!r} needs a 'text_config' object")
    merged = dict(text)
    merged.setdefault("model_type", "qwen3_5_moe_text")
    merged.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return merged


def qwen3_5_moe_published_names(config: dict[str, Any]):
    """A multimodal wrapper's text tensors sit under `model.language_model.` in the published checkpoints,
    which other engines' readers match exactly; Ferry reads either."""
    if "text_config" not in config:
        return lambda name: name
    return lambda name: "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name


def interleaved_gated_deltanet_shapes(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    """qwen3_next's Gated DeltaNet: in_proj_qkvz and in_proj_ba, rows grouped by key head."""
    h = spec.hidden_size
    in_proj = {
        "in_proj_qkvz.weight": (2 * spec.linear_key_dim + 2 * spec.linear_value_dim, h),
        "in_proj_ba.weight": (2 * spec.linear_num_value_heads, h),
    }
    return gated_deltanet_with(spec, p, in_proj)


register(
    ModelFamily(
        name="qwen3_next",
        model_types=("qwen3_next",),
        architectures=("Qwen3NextForCausalLM",),
        spec_fields=qwen3_next_fields,
        resident_weight_shapes=lambda spec: decoder_shapes(
            spec, {FULL_ATTENTION: attention_shapes, LINEAR_ATTENTION: interleaved_gated_deltanet_shapes}
        ),
    )
)

register(
    ModelFamily(
        name="qwen3_5_moe",
        model_types=(WRAPPER_MODEL_TYPE, "qwen3_5_moe_text"),
        architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
        spec_fields=qwen3_5_moe_fields,
        resident_weight_shapes=lambda spec: decoder_shapes(
            spec, {FULL_ATTENTION: attention_shapes, LINEAR_ATTENTION: gated_deltanet_shapes}
        ),
        text_config=qwen3_5_moe_text_config,
        published_names=qwen3_5_moe_published_names,
        # both layer kinds, more value heads than key heads; the text-only model (no vision tower)
        tiny_config=dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            shared_expert_intermediate_size=32,
            linear_conv_kernel_dim=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
        reference_classes=("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    )
)
