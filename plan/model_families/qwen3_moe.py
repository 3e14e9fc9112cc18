"""qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): full attention in every layer, routed MoE
without a shared expert (dense MLPs where `mlp_only_layers` / `decoder_sparse_step` say), plain RMSNorms.
The worker's half: services/worker/models/qwen3_moe.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferry.plan.model_families import ModelFamily, register
from ferry.plan.model_families.spec_fields import attention_fields, mlp_fields, sparse_step_moe_layers
from ferry.plan.model_families.weight_shapes import attention_shapes, decoder_shapes
from ferry.plan.model_spec import FULL_ATTENTION, ModelSpec
from ferry.shared.errors import ConfigError


def spec_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    num_layers = int(cfg["num_hidden_layers"])
    return dict(
        layer_types=(FULL_ATTENTION,) * num_layers,
        moe_layers=sparse_step_moe_layers(cfg, num_layers),
        **attention_fields(cfg, where, partial_rotary_factor=1.0, output_gate=False),
        **mlp_fields(cfg, norm_topk_prob=False, shared_expert=False),
    )


GGUF_ARCHITECTURE = "qwen3moe"


def gguf_config(metadata: dict[str, Any], tensors: Mapping[str, Any], where: str) -> dict[str, Any]:
    """config.json from a qwen3moe GGUF: transformers' table, and what it leaves out (the experts' width,
    which layers are dense)."""
    from ferry.plan.gguf_checkpoint import GgufNames, moe_layers_of, transformers_gguf_fields

    config = transformers_gguf_fields(metadata, GGUF_ARCHITECTURE, "qwen3_moe")
    config["model_type"] = "qwen3_moe"
    width = metadata.get(f"{GGUF_ARCHITECTURE}.expert_feed_forward_length")
    if width is None:
        raise ConfigError(f"{where}: the GGUF metadata lacks {GGUF_ARCHITECTURE}.expert_feed_forward_length")
    config["moe_intermediate_size"] = int(width)
    layers = int(config.get("num_hidden_layers", 0))
    moe = set(moe_layers_of(tensors, layers, GgufNames(GGUF_ARCHITECTURE, layers)))
    config["mlp_only_layers"] = [layer for layer in range(layers) if layer not in moe]
    return config


def resident_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return decoder_shapes(spec, {FULL_ATTENTION: attention_shapes})


def gguf_write_metadata(writer, config: dict) -> None:
    if config.get("mlp_only_layers") or not config.get("norm_topk_prob"):
        # llama.cpp's qwen3moe graph renormalizes the top k, and its table names no dense MLP beside routed experts
        raise ValueError("the GGUF writer takes a qwen3_moe checkpoint of MoE layers only, with norm_topk_prob")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


register(
    ModelFamily(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        architectures=("Qwen3MoeForCausalLM",),
        spec_fields=spec_fields,
        resident_weight_shapes=resident_weight_shapes,
        # three layers, one of them dense only where a test asks (tests/unit/tiny_models.py)
        tiny_config=dict(num_hidden_layers=3, intermediate_size=128, norm_topk_prob=True, rope_theta=10000.0),
        reference_classes=("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        gguf_architectures=(GGUF_ARCHITECTURE,),
        gguf_config=gguf_config,
        gguf_write_metadata=gguf_write_metadata,
    )
)
