"""A model's architecture, read from a Hugging Face `config.json` into one frozen object.

Supported: `qwen3_moe` (full attention + MoE), `qwen3_next` and `qwen3_5_moe` (hybrid: Gated
DeltaNet linear attention + gated full attention + MoE with a shared expert). `qwen3_5_moe`
checkpoints ship a multimodal wrapper whose `text_config` holds the text model; `transformers`
also writes the text model flat as `qwen3_5_moe_text`. Only the text tower is served.

No torch here: the planner (`ferry plan`) runs from this on any machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry.plan.quantization import QuantScheme, parse_quantization
from ferry.shared.errors import ConfigError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# model_type as written in config.json -> the architecture family we implement
ARCHITECTURES = {
    "qwen3_moe": "qwen3_moe",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5_moe")

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def normalize_dtype(name: str) -> str:
    name = DTYPE_ALIASES.get(str(name).lower().removeprefix("torch."), str(name).lower().removeprefix("torch."))
    if name not in DTYPE_BYTES:
        raise ConfigError(f"unsupported dtype {name!r}: use one of {', '.join(DTYPE_BYTES)} (--dtype)")
    return name


@dataclass(frozen=True)
class ModelSpec:
    """Everything the planner, the loader and the models need to know about an architecture."""

    arch: str  # qwen3_moe | qwen3_next | qwen3_5_moe
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # FULL_ATTENTION | LINEAR_ATTENTION per layer
    moe_layers: tuple[bool, ...]  # True where the layer's MLP is the routed MoE block
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str  # the checkpoint's dtype
    # full attention
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    attn_output_gate: bool  # q_proj also yields a sigmoid gate on the attention output
    rope_theta: float
    partial_rotary_factor: float
    # MLPs
    intermediate_size: int  # dense MLP layers (mlp_only_layers), 0 when there are none
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    # Gated DeltaNet (linear attention); zeros for qwen3_moe
    linear_conv_kernel_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # the checkpoint's quantization (plan/quantization.py); None: unquantized
    quantization: QuantScheme | None = None
    text_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        return self.arch in HYBRID_ARCHITECTURES

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.moe_layers) if m)

    @property
    def total_experts(self) -> int:
        return len(self.moe_layer_indices) * self.num_experts

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv1d: q, k and v of the Gated DeltaNet."""
        return 2 * self.linear_key_dim + self.linear_value_dim


def _first(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def _require(d: dict[str, Any], name: str, where: str) -> Any:
    if d.get(name) is None:
        raise ConfigError(f"{where}: field {name!r} is missing")
    return d[name]


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    model_type = raw.get("model_type")
    if model_type == "qwen3_5_moe":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("config.json: model_type 'qwen3_5_moe' needs a 'text_config' object")
        merged = dict(text)
        merged.setdefault("model_type", "qwen3_5_moe_text")
        merged.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        return merged
    return raw


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int, where: str) -> tuple[str, ...]:
    if arch == "qwen3_moe":
        return (FULL_ATTENTION,) * num_layers
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


def _moe_layers(cfg: dict[str, Any], arch: str, num_layers: int, num_experts: int) -> tuple[bool, ...]:
    if num_experts <= 0:
        return (False,) * num_layers
    if arch == "qwen3_5_moe":
        return (True,) * num_layers
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return tuple(i not in mlp_only and (i + 1) % step == 0 for i in range(num_layers))


def parse_model_config(
    raw: dict[str, Any], where: str = "config.json", hf_quant_config: dict[str, Any] | None = None
) -> ModelSpec:
    """Build a ModelSpec from a config.json dict (and the checkpoint's hf_quant_config.json, when it
    has one); a clear ConfigError for anything we cannot serve."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    outer_type = raw.get("model_type")
    if outer_type not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: model_type {outer_type!r} is not supported; Ferry serves " + ", ".join(sorted(ARCHITECTURES))
        )
    cfg = _text_config(raw)
    arch = ARCHITECTURES[outer_type]
    num_layers = int(_require(cfg, "num_hidden_layers", where))
    attention = _attention_fields(cfg, arch, where)
    num_experts = int(_first(cfg, "num_experts", "num_local_experts", default=0))
    mlp = _mlp_fields(cfg, arch, num_experts)
    dtype = normalize_dtype(
        _first(cfg, "torch_dtype", "dtype", default=_first(raw, "torch_dtype", "dtype", default="bfloat16"))
    )
    spec = ModelSpec(
        arch=arch,
        vocab_size=int(_require(cfg, "vocab_size", where)),
        num_layers=num_layers,
        layer_types=_layer_types(cfg, arch, num_layers, where),
        moe_layers=_moe_layers(cfg, arch, num_layers, num_experts),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        dtype=dtype,
        quantization=parse_quantization(raw, hf_quant_config, where),
        text_config=cfg,
        **attention,
        **mlp,
        **_linear_attention_fields(cfg, arch),
    )
    _validate(spec, where)
    return spec


def _attention_fields(cfg: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """Hidden size, heads and rotary embedding (the rope fields moved into rope_parameters in
    newer configs; hybrids rotate a quarter of each head by default)."""
    hidden = int(_require(cfg, "hidden_size", where))
    heads = int(_require(cfg, "num_attention_heads", where))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    default_partial = 0.25 if arch in HYBRID_ARCHITECTURES else 1.0
    return dict(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(_first(cfg, "num_key_value_heads", default=heads)),
        head_dim=int(_first(cfg, "head_dim", default=hidden // max(heads, 1))),
        attention_bias=bool(cfg.get("attention_bias", False)),
        attn_output_gate=bool(cfg.get("attn_output_gate", arch in HYBRID_ARCHITECTURES)),
        rope_theta=float(_first(cfg, "rope_theta", default=rope.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(
            _first(cfg, "partial_rotary_factor", default=rope.get("partial_rotary_factor", default_partial))
        ),
    )


def _mlp_fields(cfg: dict[str, Any], arch: str, num_experts: int) -> dict[str, Any]:
    """Routed experts, the shared expert (hybrids only) and dense MLP layers."""
    return dict(
        intermediate_size=int(cfg.get("intermediate_size", 0) or 0),
        num_experts=num_experts,
        num_experts_per_tok=int(_first(cfg, "num_experts_per_tok", default=0)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
        # qwen3_5_moe's router always renormalises its top-k weights (no flag in its config)
        norm_topk_prob=bool(cfg.get("norm_topk_prob", arch == "qwen3_5_moe" or arch == "qwen3_next")),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0)
        if arch in HYBRID_ARCHITECTURES
        else 0,
    )


def _linear_attention_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The Gated DeltaNet's shapes; zeros for architectures without linear attention."""
    names = (
        "linear_conv_kernel_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
    )
    hybrid = arch in HYBRID_ARCHITECTURES
    return {name: int(cfg.get(name, 0) or 0) if hybrid else 0 for name in names}


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
    if spec.num_experts <= 0:
        problems.append("num_experts (or num_local_experts) must be positive: Ferry serves MoE models")
    elif not 0 < spec.num_experts_per_tok <= spec.num_experts:
        problems.append(
            f"num_experts_per_tok ({spec.num_experts_per_tok}) must be between 1 and num_experts ({spec.num_experts})"
        )
    if spec.num_experts > 0 and spec.moe_intermediate_size <= 0:
        problems.append("moe_intermediate_size must be positive")
    if any(not m for m in spec.moe_layers) and spec.intermediate_size <= 0:
        problems.append("dense MLP layers (mlp_only_layers / decoder_sparse_step) need intermediate_size > 0")
    if not 0 < spec.partial_rotary_factor <= 1:
        problems.append(f"partial_rotary_factor must be in (0, 1], got {spec.partial_rotary_factor}")
    elif int(spec.head_dim * spec.partial_rotary_factor) % 2:
        problems.append("head_dim * partial_rotary_factor must be even")
    if not spec.full_attention_layers:
        problems.append("the model has no full-attention layer")
    if spec.linear_attention_layers:
        for name in (
            "linear_conv_kernel_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
        ):
            if getattr(spec, name) <= 0:
                problems.append(f"{name} must be positive for linear_attention layers")
        if spec.linear_num_key_heads > 0 and spec.linear_num_value_heads % spec.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if problems:
        raise ConfigError(f"{where}: inconsistent model config: " + "; ".join(problems))


def load_model_config(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir} (--model)")
    raw = _read_json(path)
    quant_path = Path(model_dir) / "hf_quant_config.json"  # modelopt's own copy of its quantization
    hf_quant = _read_json(quant_path) if quant_path.is_file() else None
    return parse_model_config(raw, where=str(path), hf_quant_config=hf_quant)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
