"""gpt_oss (gpt-oss-20b, gpt-oss-120b): softmax attention in every layer, alternately over a sliding window
and the whole context, and a routed MoE block without a shared expert.

What it computes differently from qwen3_moe, each a generic ModelSpec field:
  * `layer_types` alternates "sliding_attention" (attending to the last `sliding_window` keys, itself
    included) and "full_attention": every layer is paged softmax attention with KV, its window in
    `attention_windows`;
  * a learned sink logit per head joins each softmax's denominator (`attention_sinks`, `self_attn.sinks`);
  * q/k/v and o_proj have biases, no q/k norms; YaRN rotary scaling (`rope_parameters` / `rope_scaling`
    with rope_type "yarn");
  * the router is a linear with a bias (`router_bias`), its top k logits softmaxed (the same weights as
    a softmax over all experts renormalised over the top k: `norm_topk_prob`);
  * the experts have biases (`expert_bias`) and the clamped SwiGLU (`expert_activation`: alpha
    `swiglu_alpha`, limit `swiglu_limit`); their size is `intermediate_size`.
Checkpoint layout (transformers' save_pretrained): the router is `mlp.router.` (Ferry's `mlp.gate.`), the
experts fused per layer, `mlp.experts.gate_up_proj` [E, H, 2I] with gate and up interleaved (even columns
gate, odd up) and `gate_up_proj_bias` [E, 2I] likewise, `down_proj` [E, I, H], `down_proj_bias` [E, H]; the
worker's half converts them (services/worker/models/gpt_oss.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferry.plan.model_families import ModelFamily, register
from ferry.plan.model_families.spec_fields import attention_fields, first, require
from ferry.plan.model_families.weight_shapes import attention_shapes, decoder_shapes
from ferry.plan.model_spec import CLAMPED_SWIGLU, FULL_ATTENTION, ModelSpec, YarnRope
from ferry.shared.errors import ConfigError

SLIDING = "sliding_attention"
# Ferry's router and gpt-oss's checkpoint names for it
ROUTER = ".mlp.gate."
CHECKPOINT_ROUTER = ".mlp.router."
DEFAULT_ROPE_THETA = 150000.0  # GptOssConfig's default_theta


def layer_windows(cfg: dict[str, Any], num_layers: int, where: str) -> tuple[int, ...]:
    """Per layer the sliding window (`sliding_window` keys) or 0 for full attention, from `layer_types`
    (default: sliding in even layers, as GptOssConfig)."""
    types = cfg.get("layer_types") or [SLIDING if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)]
    if len(types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
    bad = sorted({t for t in types if t not in (SLIDING, FULL_ATTENTION)})
    if bad:
        raise ConfigError(f"{where}: unknown layer_types {bad}; expected {SLIDING!r} or {FULL_ATTENTION!r}")
    window = int(first(cfg, "sliding_window", default=0))
    if SLIDING in types and window <= 0:
        raise ConfigError(f"{where}: sliding_window must be positive for sliding_attention layers, got {window}")
    return tuple(window if t == SLIDING else 0 for t in types)


def yarn_rope(cfg: dict[str, Any], where: str) -> YarnRope | None:
    """The rotary scaling of `rope_parameters` (or the older `rope_scaling`): YaRN, or None for plain RoPE;
    a ConfigError naming the field for any other kind."""
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = cfg.get(field) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"{where}: {field}.rope_type {kind!r} is not supported (yarn or default)")
    original = first(rope, "original_max_position_embeddings", default=cfg.get("initial_context_length"))
    if not rope.get("factor") or not original:
        raise ConfigError(f"{where}: {field} of rope_type yarn needs factor and original_max_position_embeddings")
    if rope.get("mscale") or rope.get("mscale_all_dim"):
        raise ConfigError(f"{where}: {field}.mscale / mscale_all_dim are not supported (set attention_factor)")
    factor = rope.get("attention_factor")
    return YarnRope(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        attention_factor=None if factor is None else float(factor),
    )


def spec_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    num_layers = int(require(cfg, "num_hidden_layers", where))
    experts = int(first(cfg, "num_local_experts", "num_experts", default=0))
    attention = attention_fields(cfg, where, partial_rotary_factor=1.0, output_gate=False)
    bias = bool(cfg.get("attention_bias", True))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    limit, alpha = float(first(cfg, "swiglu_limit", default=7.0)), float(first(cfg, "swiglu_alpha", default=1.702))
    if limit <= 0:
        raise ConfigError(f"{where}: swiglu_limit must be positive, got {limit}")
    return dict(
        layer_types=(FULL_ATTENTION,) * num_layers,
        attention_windows=layer_windows(cfg, num_layers, where),
        moe_layers=(experts > 0,) * num_layers,
        **dict(
            attention,
            attention_bias=bias,
            attention_output_bias=bias,
            rope_theta=float(first(cfg, "rope_theta", default=rope.get("rope_theta", DEFAULT_ROPE_THETA))),
        ),
        qk_norm=False,
        attention_sinks=True,
        rope_yarn=yarn_rope(cfg, where),
        intermediate_size=0,
        num_experts=experts,
        num_experts_per_tok=int(first(cfg, "num_experts_per_tok", "experts_per_token", default=0)),
        moe_intermediate_size=int(require(cfg, "intermediate_size", where)),
        norm_topk_prob=True,  # softmax over the top k logits
        shared_expert_intermediate_size=0,
        router_bias=True,
        expert_bias=True,
        expert_activation=CLAMPED_SWIGLU,
        swiglu_alpha=alpha,
        swiglu_limit=limit,
    )


GGUF_ARCHITECTURE = "gpt-oss"
# llama.cpp writes the window under attention. (transformers' GGUF table reads `sliding_window`, which no file has)
GGUF_SLIDING_WINDOW = "attention.sliding_window"
GGUF_REQUIRED = ("expert_feed_forward_length", "block_count", GGUF_SLIDING_WINDOW)
# gpt-oss's published YaRN parameters that llama.cpp's converter does not write (its graph fixes them)
GGUF_YARN_DEFAULTS = dict(beta_fast=32.0, beta_slow=1.0, truncate=False)


def gguf_config(metadata: dict[str, Any], tensors: Mapping[str, Any], where: str) -> dict[str, Any]:
    """config.json from a gpt-oss GGUF (llama.cpp's GptOssModel): transformers' table, the experts' width
    (expert_feed_forward_length), the head size, YaRN from rope.scaling.*, biases where their tensors are; the
    sliding layers are the even ones, as llama.cpp's graph fixes them (it writes no layer types)."""
    from ferry.plan.gguf_checkpoint import transformers_gguf_fields

    def key(name: str) -> Any:
        return metadata.get(f"{GGUF_ARCHITECTURE}.{name}")

    config = transformers_gguf_fields(metadata, GGUF_ARCHITECTURE, "gpt_oss")
    config["model_type"] = "gpt_oss"
    config["architectures"] = ["GptOssForCausalLM"]
    for name in GGUF_REQUIRED:
        if key(name) is None:
            raise ConfigError(f"{where}: the GGUF metadata lacks {GGUF_ARCHITECTURE}.{name}")
    config["intermediate_size"] = int(key("expert_feed_forward_length"))
    config["sliding_window"] = int(key(GGUF_SLIDING_WINDOW))
    if key("attention.key_length") is not None:
        config["head_dim"] = int(key("attention.key_length"))
    layers = int(config["num_hidden_layers"])
    config["layer_types"] = [SLIDING if i % 2 == 0 else FULL_ATTENTION for i in range(layers)]
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    rope = {"rope_theta": float(config.pop("rope_theta", DEFAULT_ROPE_THETA)), "rope_type": "default"}
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none", "yarn"):
        raise ConfigError(f"{where}: {GGUF_ARCHITECTURE}.rope.scaling.type {scaling!r} is not supported (yarn)")
    if scaling == "yarn":
        rope.update(
            rope_type="yarn",
            factor=float(key("rope.scaling.factor")),
            original_max_position_embeddings=int(key("rope.scaling.original_context_length")),
            **GGUF_YARN_DEFAULTS,
        )
    config["rope_parameters"] = rope
    return config


def checkpoint_name(name: str) -> str:
    """A name as weight_shapes writes it -> as gpt-oss's checkpoints store it."""
    return name.replace(ROUTER, CHECKPOINT_ROUTER)


def resident_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    shapes = decoder_shapes(spec, {FULL_ATTENTION: attention_shapes})
    return {checkpoint_name(name): shape for name, shape in shapes.items()}


def gguf_write_metadata(writer, config: dict) -> None:
    """As llama.cpp's GptOssModel: the experts' width is intermediate_size, YaRN in rope.scaling.*; its graph
    fixes the sliding layers to the even ones and YaRN's betas, so a checkpoint differing there has no GGUF."""
    import gguf

    layers = int(config["num_hidden_layers"])
    even_sliding = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if config.get("layer_types", even_sliding) != even_sliding:
        raise ValueError("the GGUF writer takes a gpt_oss checkpoint whose even layers slide, as llama.cpp's graph")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    writer.add_block_count(layers)
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_sliding_window(config["sliding_window"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", 4096))


def gguf_split_experts(tensors: dict, layer: int, experts: int) -> tuple[dict, dict]:
    """gpt-oss's fused experts (popped) split as llama.cpp's converter does: `gate_up_proj` [E, H, 2I] with gate and
    up interleaved -> gate [E, I, H] and up; `down_proj` [E, I, H] -> [E, H, I]; their biases likewise."""
    import numpy as np

    prefix = f"model.layers.{layer}.mlp.experts"
    gate_up = tensors.pop(f"{prefix}.gate_up_proj").astype(np.float32).transpose(0, 2, 1)
    gate_up_bias = tensors.pop(f"{prefix}.gate_up_proj_bias").astype(np.float32)
    weights = {
        "gate_proj": np.ascontiguousarray(gate_up[:, 0::2]),
        "up_proj": np.ascontiguousarray(gate_up[:, 1::2]),
        "down_proj": np.ascontiguousarray(tensors.pop(f"{prefix}.down_proj").astype(np.float32).transpose(0, 2, 1)),
    }
    biases = {
        "gate_proj": np.ascontiguousarray(gate_up_bias[:, 0::2]),
        "up_proj": np.ascontiguousarray(gate_up_bias[:, 1::2]),
        "down_proj": tensors.pop(f"{prefix}.down_proj_bias").astype(np.float32),
    }
    return weights, biases


register(
    ModelFamily(
        name="gpt_oss",
        model_types=("gpt_oss",),
        architectures=("GptOssForCausalLM",),
        spec_fields=spec_fields,
        resident_weight_shapes=resident_weight_shapes,
        # a sliding layer then a full one, a window of 8 that a short prompt already outgrows, YaRN
        tiny_config=dict(num_hidden_layers=2, intermediate_size=32, sliding_window=8, attention_bias=True),
        reference_classes=("GptOssConfig", "GptOssForCausalLM"),
        chat_format="harmony",
        gguf_architectures=(GGUF_ARCHITECTURE,),
        gguf_config=gguf_config,  # gpt-oss is trained on harmony's framing (services/api/harmony_format.py)
        gguf_write_metadata=gguf_write_metadata,
        gguf_split_experts=gguf_split_experts,
    )
)
