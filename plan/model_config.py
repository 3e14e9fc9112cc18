"""A model's architecture, read from a Hugging Face `config.json` (or a GGUF file's metadata, as the
config.json it stands for: plan/gguf_checkpoint.py) into one frozen `ModelSpec`.

The family that claims config.json's `model_type` (or one of its `architectures`) reads its own fields
(plan/model_families/: qwen3_moe, and the hybrids qwen3_next and qwen3_5_moe); the fields every model has
are read here, and the whole is checked for what no forward could serve. Only the text tower is served.

No torch here: the planner (`ferry plan`) runs from this on any machine.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ferry.plan import expert_formats
from ferry.plan.dtypes import normalize_dtype
from ferry.plan.gguf_checkpoint import find_gguf, load_gguf_config
from ferry.plan.model_families import family_for_config
from ferry.plan.model_families.spec_fields import GATED_DELTANET_FIELDS, first, require
from ferry.plan.model_spec import CLAMPED_SWIGLU, FULL_ATTENTION, GELU_TANH, LINEAR_ATTENTION, SILU, ModelSpec
from ferry.plan.mtp_layer import checkpoint_mtp_layers
from ferry.plan.quantization import parse_quantization
from ferry.shared.errors import ConfigError

__all__ = [
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "ModelSpec",
    "load_model_config",
    "parse_model_config",
]


def parse_model_config(
    raw: dict[str, Any], where: str = "config.json", hf_quant_config: dict[str, Any] | None = None
) -> ModelSpec:
    """Build a ModelSpec from a config.json dict (and the checkpoint's hf_quant_config.json, when it
    has one); a clear ConfigError for anything we cannot serve."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    family = family_for_config(raw, where)
    cfg = family.text_config(raw, where)
    num_layers = int(require(cfg, "num_hidden_layers", where))
    dtype = normalize_dtype(
        first(cfg, "torch_dtype", "dtype", default=first(raw, "torch_dtype", "dtype", default="bfloat16"))
    )
    spec = ModelSpec(
        arch=family.name,
        vocab_size=int(require(cfg, "vocab_size", where)),
        num_layers=num_layers,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        dtype=dtype,
        quantization=parse_quantization(raw, hf_quant_config, where, family.experts_module),
        text_config=cfg,
        **family.spec_fields(cfg, where),
    )
    _validate(spec, where)
    return spec


def _validate(spec: ModelSpec, where: str) -> None:
    problems = []
    for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim"):
        if getattr(spec, name) <= 0:
            problems.append(f"{name} must be positive, got {getattr(spec, name)}")
    if spec.num_kv_heads > 0 and spec.num_attention_heads % spec.num_kv_heads:
        problems.append(
            f"num_attention_heads ({spec.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({spec.num_kv_heads})"
        )
    problems.extend(_layer_attention_problems(spec))
    if spec.num_experts <= 0:
        problems.append("num_experts (or num_local_experts) must be positive: Ferry serves MoE models")
    elif not 0 < spec.num_experts_per_tok <= spec.num_experts:
        problems.append(
            f"num_experts_per_tok ({spec.num_experts_per_tok}) must be between 1 and num_experts ({spec.num_experts})"
        )
    if spec.num_experts > 0 and spec.moe_intermediate_size <= 0:
        problems.append("moe_intermediate_size must be positive")
    if any(not m for m in spec.moe_layers) and spec.intermediate_size <= 0:
        problems.append(
            "dense MLP layers (mlp_only_layers / decoder_sparse_step / first_k_dense_replace) "
            "need intermediate_size > 0"
        )
    problems.extend(_router_problems(spec))
    problems.extend(_expert_problems(spec))
    if spec.attention_windows and len(spec.attention_windows) != spec.num_layers:
        problems.append(f"attention_windows has {len(spec.attention_windows)} entries for {spec.num_layers} layers")
    for name in ("attention_kv_heads", "attention_head_dims"):
        per_layer = getattr(spec, name)
        if per_layer and (len(per_layer) != spec.num_layers or min(per_layer) <= 0):
            problems.append(f"{name} needs a positive entry for each of the {spec.num_layers} layers")
    fmt = expert_formats.format_of(spec)
    if fmt.quantized and spec.num_experts > 0 and spec.moe_intermediate_size > 0 and spec.hidden_size > 0:
        try:  # its scale groups must tile both projections' inputs
            fmt.expert_layouts(spec)
        except ValueError as e:
            problems.append(f"hidden_size ({spec.hidden_size}) and moe_intermediate_size: {e}")
    if not 0 < spec.partial_rotary_factor <= 1:
        problems.append(f"partial_rotary_factor must be in (0, 1], got {spec.partial_rotary_factor}")
    elif int(spec.head_dim * spec.partial_rotary_factor) % 2:
        problems.append("head_dim * partial_rotary_factor must be even")
    if not spec.full_attention_layers:
        problems.append("the model has no full-attention layer")
    if spec.linear_attention_layers:
        for name in GATED_DELTANET_FIELDS:
            if getattr(spec, name) <= 0:
                problems.append(f"{name} must be positive for linear_attention layers")
        if spec.linear_num_key_heads > 0 and spec.linear_num_value_heads % spec.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if problems:
        raise ConfigError(f"{where}: inconsistent model config: " + "; ".join(problems))


def _layer_attention_problems(spec: ModelSpec) -> list[str]:
    """Where layers differ in attention (attention_head_dims, attention_kv_heads, layer_value_is_key, layer_ropes):
    one entry a layer, KV heads that divide the query heads, even head sizes."""
    problems = []
    for name in ("layer_value_is_key", "layer_ropes"):
        if getattr(spec, name) and len(getattr(spec, name)) != spec.num_layers:
            problems.append(f"{name} has {len(getattr(spec, name))} entries for {spec.num_layers} layers")
    per_layer = (spec.attention_kv_heads, spec.attention_head_dims)
    if problems or any(values and len(values) != spec.num_layers for values in per_layer):
        return problems  # (the shapes' lengths are _validate's to report)
    for i in range(spec.num_layers):
        kv_heads, head_dim = spec.layer_kv_heads(i), spec.layer_head_dim(i)
        if kv_heads <= 0 or head_dim <= 0 or head_dim % 2 or spec.num_attention_heads % kv_heads:
            problems.append(
                f"layer {i}: {kv_heads} KV heads of {head_dim} channels for {spec.num_attention_heads} query heads "
                "(num_key_value_heads / num_global_key_value_heads must divide num_attention_heads; head sizes even)"
            )
        if spec.layer_ropes and not 0 < spec.layer_ropes[i].partial_rotary_factor <= 1:
            problems.append(f"layer {i}: partial_rotary_factor must be in (0, 1]")
    if spec.mlp_activation not in (SILU, GELU_TANH):
        problems.append(f"dense MLP activation {spec.mlp_activation!r} is not one of {SILU}, {GELU_TANH}")
    return problems


ROUTER_SCORINGS = ("softmax", "sigmoid")
EXPERT_ACTIVATIONS = (SILU, CLAMPED_SWIGLU, GELU_TANH)


def _expert_problems(spec: ModelSpec) -> list[str]:
    """The experts' activation is one the expert kernels compute, and an expert with biases or another activation
    than SiLU is in a format whose rows hold the biases and whose kernels compute both (`holds_biases`)."""
    if spec.expert_activation not in EXPERT_ACTIVATIONS:
        return [f"expert activation {spec.expert_activation!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}"]
    fmt = expert_formats.format_of(spec)
    if (spec.expert_bias or spec.expert_activation != SILU) and not fmt.holds_biases:
        return [
            f"the routed experts have biases or the {spec.expert_activation} activation, which {fmt.name} "
            "experts are not held or computed with (quantization_config)"
        ]
    return []


def _router_problems(spec: ModelSpec) -> list[str]:
    """Group-limited routing needs groups of equal size, at least two experts each (a group's score is its
    two best experts'), and enough experts in the chosen groups for the top k."""
    if spec.router_scoring not in ROUTER_SCORINGS:
        return [f"router scoring {spec.router_scoring!r} is not one of {', '.join(ROUTER_SCORINGS)}"]
    groups, chosen = spec.router_groups, spec.router_topk_groups
    sigmoid_only = spec.router_score_bias or groups != 1 or chosen != 1 or spec.routed_scaling_factor != 1.0
    if spec.router_scoring == "softmax" and sigmoid_only:
        # the softmax router (layers/mlp.py, kernels/router_topk.py) has none of these: refused, never ignored
        return ["a score bias, expert groups and routed_scaling_factor are served with sigmoid router scoring only"]
    if groups == 1 and chosen == 1 or spec.num_experts <= 0:
        return []
    if groups < 1 or spec.num_experts % groups or spec.num_experts // groups < 2:
        return [f"n_group ({groups}) must divide the {spec.num_experts} experts into groups of two or more"]
    if not 0 < chosen <= groups:
        return [f"topk_group ({chosen}) must be between 1 and n_group ({groups})"]
    if spec.num_experts_per_tok > chosen * (spec.num_experts // groups):
        return [
            f"num_experts_per_tok ({spec.num_experts_per_tok}) exceeds the experts of topk_group ({chosen}) "
            f"groups of {spec.num_experts // groups}"
        ]
    return []


def load_model_config(model_dir: str | Path) -> ModelSpec:
    """From `model_dir`'s config.json, or from the metadata of the GGUF file it is (or holds:
    plan/gguf_checkpoint.py)."""
    gguf = find_gguf(model_dir)
    if gguf is not None:
        return parse_model_config(load_gguf_config(gguf), where=str(gguf))
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir} (--model)")
    raw = _read_json(path)
    quant_path = Path(model_dir) / "hf_quant_config.json"  # modelopt's own copy of its quantization
    hf_quant = _read_json(quant_path) if quant_path.is_file() else None
    spec = parse_model_config(raw, where=str(path), hf_quant_config=hf_quant)
    return _with_checkpoint_mtp_layers(spec, raw, Path(model_dir), str(path))


def _with_checkpoint_mtp_layers(spec: ModelSpec, raw: dict[str, Any], model_dir: Path, where: str) -> ModelSpec:
    """A config that does not count its MTP layers (Qwen3-Next's published one, whose checkpoint holds one under
    `mtp.`; vLLM then takes one too): the layers the checkpoint holds (plan/mtp_layer.py)."""
    family = family_for_config(raw, where)
    key = family.mtp_config_key
    if key is None or family.mtp_renames is not None or key in family.text_config(raw, where):
        return spec
    layers = checkpoint_mtp_layers(model_dir)
    return dataclasses.replace(spec, mtp_draft_layers=layers) if layers else spec


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
