"""gemma4 (Gemma 4 MoE: gemma-4-26B-A4B, text tower): softmax attention in every layer, five over a sliding
window to one over the whole context, and in every layer a dense MLP beside a routed MoE block.

What it computes differently from qwen3_moe, each a generic ModelSpec field:
  * `layer_types` alternates "sliding_attention" (the last `sliding_window` keys, itself included:
    `attention_windows`) and "full_attention" (the last layer always full, as Gemma4TextConfig forces it);
    the two kinds differ in head size (`head_dim` / `global_head_dim`: `attention_head_dims`), KV heads
    (`num_key_value_heads` / `num_global_key_value_heads` where `attention_k_eq_v`: `attention_kv_heads`), and
    rotary embedding (`rope_parameters` keyed by layer type: `layer_ropes`; "proportional" turns the first
    `partial_rotary_factor` of the head's frequency pairs, paired across the whole head);
  * with `attention_k_eq_v`, a full layer has no v_proj: its values are its keys' projection, before the k
    norm and the rotary embedding (`layer_value_is_key`);
  * q and k get RMSNorms, v one without a weight (`value_norm`), and the softmax scale is 1 (`attention_scale`);
  * every layer's MLP is a gelu_pytorch_tanh dense MLP (`mlp_activation`) beside the routed experts
    (`moe_beside_dense_mlp`), each output normed on its own, summed and normed again; the experts' inputs are
    normed apart, gelu_pytorch_tanh too (`expert_activation`);
  * the router RMS-normalises the layer's input (no weight), scales it by `router.scale` and hidden ** -0.5,
    softmaxes its logits over all experts, renormalises the top k and multiplies each by its expert's
    `router.per_expert_scale` (the worker's half computes it: services/worker/models/gemma4.py);
  * the embeddings are multiplied by sqrt(hidden_size) (`embedding_multiplier`), each layer's output by its
    `layer_scalar`, and the logits are soft-capped (`final_logit_softcapping`); the head is the embedding.
Checkpoint layout (transformers' Gemma4): a multimodal wrapper (model_type `gemma4`, the text model in
`text_config`) whose text tensors sit under `model.language_model.`, its vision and audio towers beside them
(not served); each layer's norms `input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
`post_feedforward_layernorm`, `{pre,post}_feedforward_layernorm_2`, `post_feedforward_layernorm_1`, the dense
MLP `mlp.{gate,up,down}_proj`, the router `router.{proj.weight,scale,per_expert_scale}`, the experts fused
`experts.gate_up_proj` [E, 2I, H] (gate's rows, then up's) and `experts.down_proj` [E, H, I], not under `mlp.`.
Its chat format is the checkpoint's own Jinja template (chat_format "template": Google's releases ship it beside
the tokenizer; transformers has no built-in Gemma template to fall back on); its output's tool calls and reasoning
are in Gemma 4's own markup (`<|tool_call>call:NAME{...}<tool_call|>`, `<|channel>thought...<channel|>`), read by
the api's gemma4 parsers (services/api/gemma4_format.py).
Not served (a ConfigError naming the field): per-layer input embeddings (`hidden_size_per_layer_input`, the
small dense Gemma 4s), layers sharing another's KV (`num_kv_shared_layers`), bidirectional text attention."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ferry.plan.model_families import ModelFamily, register
from ferry.plan.model_families.spec_fields import first, require
from ferry.plan.model_spec import FULL_ATTENTION, GELU_TANH, LayerRope, ModelSpec
from ferry.shared.errors import ConfigError

SLIDING = "sliding_attention"
WRAPPER_MODEL_TYPE = "gemma4"
TEXT_MODEL_TYPE = "gemma4_text"
GELU_ACTIVATIONS = ("gelu_pytorch_tanh",)
DEFAULT_SLIDING_PATTERN = 6  # Gemma4TextConfig: five sliding layers, then a full one
PLE_DEFAULT = 256  # Gemma4TextConfig's hidden_size_per_layer_input
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL_ATTENTION: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def text_config(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The wrapper's `text_config` (a flat `gemma4_text` config as it is)."""
    if raw.get("model_type") != WRAPPER_MODEL_TYPE:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: model_type {WRAPPER_MODEL_TYPE!r} needs a 'text_config' object")
    merged = dict(text)
    merged.setdefault("model_type", TEXT_MODEL_TYPE)
    merged.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", True))
    return merged


def published_names(config: dict[str, Any]):
    """The wrapper's text tensors sit under `model.language_model.` in the published checkpoints."""
    if "text_config" not in config:
        return lambda name: name
    return lambda name: "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name


def layer_types(cfg: dict[str, Any], num_layers: int, where: str) -> tuple[str, ...]:
    types = list(
        cfg.get("layer_types")
        or [SLIDING if (i + 1) % DEFAULT_SLIDING_PATTERN else FULL_ATTENTION for i in range(num_layers)]
    )
    if len(types) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
    bad = sorted({t for t in types if t not in (SLIDING, FULL_ATTENTION)})
    if bad:
        raise ConfigError(f"{where}: unknown layer_types {bad}; expected {SLIDING!r} or {FULL_ATTENTION!r}")
    types[-1] = FULL_ATTENTION  # Gemma4TextConfig forces the last layer to full attention
    return tuple(types)


def layer_rope(cfg: dict[str, Any], kind: str, where: str) -> LayerRope:
    """`rope_parameters[kind]`: "default" (every pair of the head turns; Gemma4's default rope ignores a
    partial_rotary_factor) or "proportional"; any other kind, or a scaling factor, is refused by field."""
    params = cfg.get("rope_parameters") or DEFAULT_ROPE
    rope = params.get(kind, DEFAULT_ROPE[kind]) if isinstance(params, dict) else None
    if not isinstance(rope, dict):
        raise ConfigError(f"{where}: rope_parameters.{kind} must be an object")
    rope_type = rope.get("rope_type", "default")
    theta = float(first(rope, "rope_theta", default=DEFAULT_ROPE[kind]["rope_theta"]))
    if float(rope.get("factor", 1.0) or 1.0) != 1.0:
        raise ConfigError(f"{where}: rope_parameters.{kind}.factor {rope['factor']} is not supported (1.0)")
    if rope_type == "default":
        return LayerRope(theta)
    if rope_type == "proportional":
        return LayerRope(theta, float(rope.get("partial_rotary_factor", 1.0)), proportional=True)
    raise ConfigError(
        f"{where}: rope_parameters.{kind}.rope_type {rope_type!r} is not supported (default, proportional)"
    )


PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


def per_layer_overrides(cfg: dict[str, Any], types: tuple[str, ...], where: str) -> dict[int, dict[str, Any]]:
    """{layer: {field: value}} of `per_layer_config`, which newer transformers write instead of global_head_dim
    and num_global_key_value_heads (keyed by layer index, or by layer type for every layer of it): where a config
    has one, it alone makes layers differ, as in Gemma4TextConfig."""
    raw = cfg.get("per_layer_config") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: per_layer_config must be an object")
    out: dict[int, dict[str, Any]] = {}
    for key, overrides in raw.items():
        if not isinstance(overrides, dict) or set(overrides) - set(PER_LAYER_FIELDS):
            raise ConfigError(f"{where}: per_layer_config[{key!r}] may set only {', '.join(PER_LAYER_FIELDS)}")
        if str(key).isdigit() and int(key) < len(types):
            layers = [int(key)]
        elif key in (SLIDING, FULL_ATTENTION):
            layers = [i for i, t in enumerate(types) if t == key]
        else:
            raise ConfigError(f"{where}: per_layer_config key {key!r} is neither a layer index nor a layer type")
        for layer in layers:
            out.setdefault(layer, {}).update(overrides)
    return out


def _refuse_unserved(cfg: dict[str, Any], where: str) -> None:
    # Gemma4TextConfig's default is 256 (the small models' per-layer embeddings): a config must say 0
    if int(first(cfg, "hidden_size_per_layer_input", default=PLE_DEFAULT)):
        raise ConfigError(f"{where}: hidden_size_per_layer_input (per-layer input embeddings) is not supported (0)")
    if int(cfg.get("num_kv_shared_layers") or 0):
        raise ConfigError(f"{where}: num_kv_shared_layers (layers reusing another's KV) is not supported (0)")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ConfigError(f"{where}: use_bidirectional_attention 'all' is not supported (causal text attention)")
    activation = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in GELU_ACTIVATIONS:
        raise ConfigError(f"{where}: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    if not cfg.get("enable_moe_block", False):
        raise ConfigError(f"{where}: enable_moe_block is false: a dense Gemma 4 (Ferry serves MoE models)")


def spec_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    _refuse_unserved(cfg, where)
    num_layers = int(require(cfg, "num_hidden_layers", where))
    types = layer_types(cfg, num_layers, where)
    hidden, heads = int(require(cfg, "hidden_size", where)), int(require(cfg, "num_attention_heads", where))
    head_dim = int(first(cfg, "head_dim", default=256))
    kv_heads = int(first(cfg, "num_key_value_heads", default=heads))
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    global_head_dim, global_kv_heads = head_dim, kv_heads
    if "per_layer_config" not in cfg:  # else it alone says where layers differ (Gemma4TextConfig)
        global_head_dim = int(first(cfg, "global_head_dim", default=512))
        # a full layer's KV heads are num_global_key_value_heads only where attention_k_eq_v
        global_kv_heads = int(first(cfg, "num_global_key_value_heads", default=kv_heads)) if k_eq_v else kv_heads
    head_dims = [head_dim if t == SLIDING else global_head_dim for t in types]
    layer_kv_heads = [kv_heads if t == SLIDING else global_kv_heads for t in types]
    for layer, overrides in per_layer_overrides(cfg, types, where).items():
        head_dims[layer] = int(overrides.get("head_dim", head_dims[layer]))
        layer_kv_heads[layer] = int(overrides.get("num_key_value_heads", layer_kv_heads[layer]))
    window = int(first(cfg, "sliding_window", default=512))
    if SLIDING in types and window <= 0:
        raise ConfigError(f"{where}: sliding_window must be positive for sliding_attention layers, got {window}")
    ropes = {kind: layer_rope(cfg, kind, where) for kind in (SLIDING, FULL_ATTENTION)}
    bias = bool(cfg.get("attention_bias", False))
    softcap = cfg.get("final_logit_softcapping")
    experts = int(first(cfg, "num_experts", default=0))
    return dict(
        layer_types=(FULL_ATTENTION,) * num_layers,  # every layer is paged softmax attention with KV
        attention_windows=tuple(window if t == SLIDING else 0 for t in types),
        moe_layers=(experts > 0,) * num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        attention_head_dims=tuple(head_dims),
        attention_kv_heads=tuple(layer_kv_heads),
        layer_value_is_key=tuple(k_eq_v and t == FULL_ATTENTION for t in types),
        layer_ropes=tuple(ropes[t] for t in types),
        attention_bias=bias,
        attention_output_bias=bias,
        attn_output_gate=False,
        rope_theta=ropes[SLIDING].theta,
        partial_rotary_factor=1.0,
        qk_norm=True,
        value_norm=True,
        attention_scale=1.0,
        intermediate_size=int(require(cfg, "intermediate_size", where)),
        num_experts=experts,
        num_experts_per_tok=int(first(cfg, "top_k_experts", "num_experts_per_tok", default=0)),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        norm_topk_prob=True,
        shared_expert_intermediate_size=0,
        mlp_activation=GELU_TANH,
        expert_activation=GELU_TANH,
        moe_beside_dense_mlp=True,
        embedding_multiplier=math.sqrt(hidden),
        final_logit_softcapping=float(softcap or 0.0),
    )


def attention_shapes(spec: ModelSpec, i: int, p: str) -> dict[str, tuple[int, ...]]:
    """Layer i's attention: its own head size and KV heads, q/k norms (v's has no weight), no v_proj where its
    values are its keys."""
    h, nh, kvh, hd = spec.hidden_size, spec.num_attention_heads, spec.layer_kv_heads(i), spec.layer_head_dim(i)
    a = p + "self_attn."
    projections = ("q_proj", "k_proj") if spec.value_is_key(i) else ("q_proj", "k_proj", "v_proj")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in projections:
        rows = nh * hd if name == "q_proj" else kvh * hd
        shapes[f"{a}{name}.weight"] = (rows, h)
        if spec.attention_bias:
            shapes[f"{a}{name}.bias"] = (rows,)
    shapes[a + "o_proj.weight"] = (h, nh * hd)
    if spec.attention_output_bias:
        shapes[a + "o_proj.bias"] = (h,)
    shapes[a + "q_norm.weight"] = (hd,)
    shapes[a + "k_norm.weight"] = (hd,)
    return shapes


LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_feedforward_layernorm_1",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_2",
)


def resident_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    h, di, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({f"{p}{norm}.weight": (h,) for norm in LAYER_NORMS})
        shapes.update(attention_shapes(spec, i, p))
        shapes[p + "mlp.gate_proj.weight"] = (di, h)
        shapes[p + "mlp.up_proj.weight"] = (di, h)
        shapes[p + "mlp.down_proj.weight"] = (h, di)
        shapes[p + "router.proj.weight"] = (e, h)
        shapes[p + "router.scale"] = (h,)
        shapes[p + "router.per_expert_scale"] = (e,)
        shapes[p + "layer_scalar"] = (1,)
    return shapes


GGUF_ARCHITECTURE = "gemma4"
GGUF_REQUIRED = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.key_length_swa",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "rope.freq_base",
    "rope.freq_base_swa",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
)
# the full layers' rotary frequency factors llama.cpp's converter writes (its Gemma4Model): 1 for each pair that
# turns (the first partial_rotary_factor of the head's pairs), 1e30 (a pair that stands still) for the rest
GGUF_ROPE_FREQS = "rope_freqs.weight"
GGUF_STILL_PAIR = 1e30


def _per_layer(value: Any, num_layers: int, key: str, where: str) -> list[int]:
    """A key llama.cpp writes as one number or one per layer, per layer."""
    values = list(value) if isinstance(value, list) else [value] * num_layers
    if len(values) != num_layers:
        raise ConfigError(f"{where}: {GGUF_ARCHITECTURE}.{key} has {len(values)} entries for {num_layers} layers")
    return [int(v) for v in values]


def _uniform(values: list[int], key: str, kind: str, where: str) -> int:
    if len(set(values)) != 1:
        raise ConfigError(f"{where}: {GGUF_ARCHITECTURE}.{key} differs between {kind} layers ({sorted(set(values))})")
    return values[0]


def _full_rotary_factor(tensors: Mapping[str, Any], head_dim: int, where: str) -> float:
    """The full layers' partial_rotary_factor from `rope_freqs` (GGUF_ROPE_FREQS): the share of its pairs at 1."""
    import numpy as np

    t = tensors.get(GGUF_ROPE_FREQS)
    if t is None:
        raise ConfigError(f"{where}: the GGUF file has no {GGUF_ROPE_FREQS} (the full layers' rotated pairs)")
    factors = np.asarray(t.data, dtype=np.float32).reshape(-1)
    turning = int((factors == 1.0).sum())
    if factors.size != head_dim // 2 or not (factors[:turning] == 1.0).all() or (factors[turning:] < 1e29).any():
        raise ConfigError(
            f"{where}: {GGUF_ROPE_FREQS} must be {head_dim // 2} factors, 1 for the pairs that turn and then "
            f"{GGUF_STILL_PAIR:g} (llama.cpp's proportional rope); other frequency factors are not supported"
        )
    return 2 * turning / head_dim


def gguf_config(metadata: dict[str, Any], tensors: Mapping[str, Any], where: str) -> dict[str, Any]:
    """config.json (gemma4_text) from a Gemma 4 GGUF as llama.cpp's Gemma4Model writes it: the sliding layers from
    the per-layer `attention.sliding_window_pattern` (true: sliding), their head size and rope from the `_swa` keys,
    the full layers' from the plain ones (their partial rotary from `rope_freqs`: `_full_rotary_factor`), KV heads
    per layer, K = V where a full layer has no attn_v; the router's scale and per-expert scale are tensors."""

    def key(name: str) -> Any:
        return metadata.get(f"{GGUF_ARCHITECTURE}.{name}")

    for name in GGUF_REQUIRED:
        if key(name) is None:
            raise ConfigError(f"{where}: the GGUF metadata lacks {GGUF_ARCHITECTURE}.{name}")
    layers = int(key("block_count"))
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ConfigError(
            f"{where}: {GGUF_ARCHITECTURE}.attention.sliding_window_pattern must be one flag a layer ({layers})"
        )
    types = [SLIDING if flag else FULL_ATTENTION for flag in pattern]
    sliding, full = [i for i, t in enumerate(types) if t == SLIDING], [i for i, t in enumerate(types) if t != SLIDING]
    kv = _per_layer(key("attention.head_count_kv"), layers, "attention.head_count_kv", where)
    kv_sliding = _uniform([kv[i] for i in sliding] or [kv[0]], "attention.head_count_kv", "sliding", where)
    kv_full = _uniform([kv[i] for i in full] or [kv_sliding], "attention.head_count_kv", "full", where)
    head_dim, global_head_dim = int(key("attention.key_length_swa")), int(key("attention.key_length"))
    rotated_swa = key("rope.dimension_count_swa")
    if rotated_swa is not None and int(rotated_swa) != head_dim:
        raise ConfigError(
            f"{where}: {GGUF_ARCHITECTURE}.rope.dimension_count_swa {rotated_swa} is not the sliding head size "
            f"{head_dim}: Gemma 4's sliding layers turn every pair"
        )
    ffn = _per_layer(key("feed_forward_length"), layers, "feed_forward_length", where)
    k_eq_v = bool(full) and all(f"blk.{i}.attn_v.weight" not in tensors for i in full)
    config: dict[str, Any] = {
        "model_type": TEXT_MODEL_TYPE,
        "architectures": ["Gemma4ForCausalLM"],
        "num_hidden_layers": layers,
        "max_position_embeddings": int(key("context_length")),
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": _uniform(ffn, "feed_forward_length", "all", where),
        "num_attention_heads": int(key("attention.head_count")),
        "num_key_value_heads": kv_sliding,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "attention_k_eq_v": k_eq_v,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": types,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa"))},
            FULL_ATTENTION: {
                "rope_type": "proportional",
                "partial_rotary_factor": _full_rotary_factor(tensors, global_head_dim, where),
                "rope_theta": float(key("rope.freq_base")),
            },
        },
        "num_experts": int(key("expert_count")),
        "top_k_experts": int(key("expert_used_count")),
        "moe_intermediate_size": int(key("expert_feed_forward_length")),
        "enable_moe_block": True,
        "hidden_activation": GELU_ACTIVATIONS[0],
        "hidden_size_per_layer_input": int(key("embedding_length_per_layer_input") or 0),
        "num_kv_shared_layers": int(key("attention.shared_kv_layers") or 0),
        "final_logit_softcapping": key("final_logit_softcapping"),
    }
    if k_eq_v:
        config["num_global_key_value_heads"] = kv_full
    elif kv_full != kv_sliding:  # a full layer of other KV heads but its own V: only per_layer_config says so
        config["per_layer_config"] = {FULL_ATTENTION: {"head_dim": global_head_dim, "num_key_value_heads": kv_full}}
    return config


def gguf_write_metadata(writer, config: dict) -> None:
    """As llama.cpp's Gemma4Model: the full layers' head size in the plain keys and the sliding layers' in the
    `_swa` ones, KV heads and the sliding flags one a layer, each kind's rope base, the experts' width; and the
    `rope_freqs` tensor it generates (the full layers' partial rotary)."""
    import numpy as np

    cfg = text_config(config, "config.json")
    layers = int(cfg["num_hidden_layers"])
    types = layer_types(cfg, layers, "config.json")
    spec = spec_fields(cfg, "config.json")
    rope = {kind: layer_rope(cfg, kind, "config.json") for kind in (SLIDING, FULL_ATTENTION)}
    full_dim = spec["attention_head_dims"][types.index(FULL_ATTENTION)]  # the last layer is always full
    writer.add_block_count(layers)
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_key_length_swa(spec["head_dim"])
    writer.add_value_length_swa(spec["head_dim"])
    writer.add_head_count_kv(list(spec["attention_kv_heads"]))
    writer.add_sliding_window(spec["attention_windows"][types.index(SLIDING)] if SLIDING in types else 0)
    writer.add_sliding_window_pattern([t == SLIDING for t in types])
    writer.add_rope_freq_base(rope[FULL_ATTENTION].theta)
    writer.add_rope_freq_base_swa(rope[SLIDING].theta)
    writer.add_rope_dimension_count(full_dim)
    writer.add_rope_dimension_count_swa(spec["head_dim"])
    writer.add_expert_feed_forward_length(spec["moe_intermediate_size"])
    writer.add_embedding_length_per_layer_input(0)
    writer.add_shared_kv_layers(0)
    if spec["final_logit_softcapping"]:
        writer.add_final_logit_softcapping(spec["final_logit_softcapping"])
    turning = int(full_dim * rope[FULL_ATTENTION].partial_rotary_factor / 2)
    freqs = np.array([1.0] * turning + [GGUF_STILL_PAIR] * (full_dim // 2 - turning), dtype=np.float32)
    writer.add_tensor(GGUF_ROPE_FREQS, freqs)


def gguf_split_experts(tensors: dict, layer: int, experts: int) -> tuple[dict, dict]:
    """Gemma 4's fused experts (popped): `gate_up_proj` [E, 2I, H], the gate's rows first -> gate and up [E, I, H];
    `down_proj` [E, H, I] as it is (llama.cpp's converter keeps them fused, as `ffn_gate_up_exps`)."""
    import numpy as np

    prefix = f"model.layers.{layer}.experts"
    gate_up = tensors.pop(f"{prefix}.gate_up_proj").astype(np.float32)
    half = gate_up.shape[1] // 2
    weights = {
        "gate_proj": np.ascontiguousarray(gate_up[:, :half]),
        "up_proj": np.ascontiguousarray(gate_up[:, half:]),
        "down_proj": tensors.pop(f"{prefix}.down_proj").astype(np.float32),
    }
    return weights, {}


register(
    ModelFamily(
        name="gemma4",
        model_types=(WRAPPER_MODEL_TYPE, TEXT_MODEL_TYPE),
        architectures=("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"),
        spec_fields=spec_fields,
        resident_weight_shapes=resident_weight_shapes,
        text_config=text_config,
        published_names=published_names,
        experts_module="experts",
        tool_call_parser="gemma4",  # services/api/gemma4_format.py
        reasoning_parser="gemma4",
        gguf_architectures=(GGUF_ARCHITECTURE,),
        gguf_config=gguf_config,
        gguf_write_metadata=gguf_write_metadata,
        gguf_split_experts=gguf_split_experts,
        # two sliding layers (a window a short prompt outgrows) then a full one with its own head size, KV
        # heads, shared K/V projection and proportional rotary; a dense MLP beside the experts; soft-capped logits
        tiny_config=dict(
            num_hidden_layers=3,
            intermediate_size=48,
            top_k_experts=2,
            global_head_dim=32,
            num_key_value_heads=2,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            sliding_window=8,
            layer_types=[SLIDING, SLIDING, FULL_ATTENTION],
            enable_moe_block=True,
            hidden_size_per_layer_input=0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL_ATTENTION: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
            },
        ),
        reference_classes=("Gemma4TextConfig", "Gemma4ForCausalLM"),
    )
)
