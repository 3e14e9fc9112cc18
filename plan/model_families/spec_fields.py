"""The config.json readers families share: each gives some of a `ModelSpec`'s fields from the text config.

A family's `spec_fields` calls the ones its checkpoints use, with its own defaults (what its transformers
config class assumes when a field is absent). No torch here."""

from __future__ import annotations

from typing import Any

from ferry.plan.model_spec import FULL_ATTENTION, LINEAR_ATTENTION
from ferry.shared.errors import ConfigError


def first(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` that `d` holds (and is not null), else `default`."""
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def require(d: dict[str, Any], name: str, where: str) -> Any:
    if d.get(name) is None:
        raise ConfigError(f"{where}: field {name!r} is missing")
    return d[name]


def num_experts(cfg: dict[str, Any]) -> int:
    return int(first(cfg, "num_experts", "num_local_experts", default=0))


def attention_fields(
    cfg: dict[str, Any], where: str, *, partial_rotary_factor: float, output_gate: bool
) -> dict[str, Any]:
    """Hidden size, heads and rotary embedding (the rope fields moved into rope_parameters in newer
    configs); `partial_rotary_factor` and `output_gate` are the family's defaults."""
    hidden = int(require(cfg, "hidden_size", where))
    heads = int(require(cfg, "num_attention_heads", where))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(first(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(first(cfg, "head_dim", default=hidden // max(heads, 1))),
        attention_bias=bool(cfg.get("attention_bias", False)),
        attention_output_bias=bool(cfg.get("attention_bias", False)),
        attn_output_gate=bool(cfg.get("attn_output_gate", output_gate)),
        rope_theta=float(first(cfg, "rope_theta", default=rope.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(
            first(cfg, "partial_rotary_factor", default=rope.get("partial_rotary_factor", partial_rotary_factor))
        ),
    )


def mlp_fields(cfg: dict[str, Any], *, norm_topk_prob: bool, shared_expert: bool) -> dict[str, Any]:
    """Routed experts, the shared expert (read only where the family has one) and dense MLP layers;
    `norm_topk_prob` is the family's default."""
    return dict(
        intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
        num_experts=num_experts(cfg),
        num_experts_per_tok=int(first(cfg, "num_experts_per_tok", default=0)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", norm_topk_prob)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0) if shared_expert else 0,
    )


GATED_DELTANET_FIELDS = (
    "linear_conv_kernel_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
)


def gated_deltanet_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The Gated DeltaNet's shapes (plan/model_config.py's validation says which must be positive)."""
    return {name: int(cfg.get(name, 0) or 0) for name in GATED_DELTANET_FIELDS}


def hybrid_layer_types(cfg: dict[str, Any], num_layers: int, where: str) -> tuple[str, ...]:
    """Per layer FULL_ATTENTION or LINEAR_ATTENTION: config.json's `layer_types`, else every
    `full_attention_interval`-th layer full attention (default 4)."""
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        if interval <= 0:
            raise ConfigError(f"{where}: full_attention_interval must be positive, got {interval}")
        return tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers))
    if len(layer_types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}")
    bad = sorted({t for t in layer_types if t not in (FULL_ATTENTION, LINEAR_ATTENTION)})
    if bad:
        raise ConfigError(f"{where}: unknown layer_types {bad}; expected {FULL_ATTENTION!r} or {LINEAR_ATTENTION!r}")
    return tuple(layer_types)


def sparse_step_moe_layers(cfg: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """MoE layers as `mlp_only_layers` and `decoder_sparse_step` say (every layer by default)."""
    if num_experts(cfg) <= 0:
        return (False,) * num_layers
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))
