"""The GPU-resident tensors of the layer kinds families share, by checkpoint name and shape.

`decoder_shapes` walks the decoder skeleton (embedding, per layer two norms, a token mixer and an MLP, final
norm, head) and asks the family's `mixers` for each layer's mixer by its `layer_types` entry; a family's
`resident_weight_shapes` is that call with its mixer kinds. Routed experts are left out (host banks or
slots hold them: plan/costs.py's `is_routed_expert`). No torch here."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ferry.plan.model_spec import ModelSpec

Shapes = dict[str, tuple[int, ...]]
# (spec, the layer's checkpoint prefix, e.g. "model.layers.3.") -> that layer part's tensors
LayerShapes = Callable[[ModelSpec, str], Shapes]


def decoder_shapes(spec: ModelSpec, mixers: Mapping[str, LayerShapes]) -> Shapes:
    """Every resident tensor of a pre-norm decoder whose layer i mixes tokens with `mixers[layer_types[i]]`."""
    h = spec.hidden_size
    shapes: Shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i, kind in enumerate(spec.layer_types):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update(mixers[kind](spec, p))
        shapes.update(moe_shapes(spec, p) if spec.moe_layers[i] else dense_mlp_shapes(spec, p))
    return shapes


def attention_shapes(spec: ModelSpec, p: str) -> Shapes:
    """Full attention with per-head q/k RMSNorms where `qk_norm` (and q_proj's output gate where
    `attn_output_gate`), q/k/v biases where `attention_bias`, o_proj's where `attention_output_bias`,
    a sink logit per head where `attention_sinks`."""
    h, nh, kvh, hd = spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    a = p + "self_attn."
    shapes = {
        a + "q_proj.weight": (nh * hd * (2 if spec.attn_output_gate else 1), h),
        a + "k_proj.weight": (kvh * hd, h),
        a + "v_proj.weight": (kvh * hd, h),
        a + "o_proj.weight": (h, nh * hd),
    }
    if spec.qk_norm:
        shapes[a + "q_norm.weight"] = (hd,)
        shapes[a + "k_norm.weight"] = (hd,)
    if spec.attention_bias:
        shapes[a + "q_proj.bias"] = (shapes[a + "q_proj.weight"][0],)
        shapes[a + "k_proj.bias"] = (kvh * hd,)
        shapes[a + "v_proj.bias"] = (kvh * hd,)
    if spec.attention_output_bias:
        shapes[a + "o_proj.bias"] = (h,)
    if spec.attention_sinks:
        shapes[a + "sinks"] = (nh,)
    return shapes


def gated_deltanet_shapes(spec: ModelSpec, p: str) -> Shapes:
    """The Gated DeltaNet with its input projection in four tensors (in_proj_qkv, _z, _b, _a)."""
    return gated_deltanet_with(
        spec,
        p,
        {
            "in_proj_qkv.weight": (spec.linear_conv_dim, spec.hidden_size),
            "in_proj_z.weight": (spec.linear_value_dim, spec.hidden_size),
            "in_proj_b.weight": (spec.linear_num_value_heads, spec.hidden_size),
            "in_proj_a.weight": (spec.linear_num_value_heads, spec.hidden_size),
        },
    )


def gated_deltanet_with(spec: ModelSpec, p: str, in_proj: Shapes) -> Shapes:
    """The Gated DeltaNet's tensors, its input projection as `in_proj` names it (relative to the mixer)."""
    a = p + "linear_attn."
    nv, vd = spec.linear_num_value_heads, spec.linear_value_dim
    shapes = {a + name: shape for name, shape in in_proj.items()}
    shapes[a + "conv1d.weight"] = (spec.linear_conv_dim, 1, spec.linear_conv_kernel_dim)
    shapes[a + "dt_bias"] = (nv,)
    shapes[a + "A_log"] = (nv,)
    shapes[a + "norm.weight"] = (spec.linear_value_head_dim,)
    shapes[a + "out_proj.weight"] = (spec.hidden_size, vd)
    return shapes


def moe_shapes(spec: ModelSpec, p: str) -> Shapes:
    """The MoE block's router (with its logit bias where `router_bias`, its choosing bias where
    `router_score_bias`) and its shared expert with, where `shared_expert_gate`, that expert's sigmoid
    gate (routed experts excluded)."""
    h, m = spec.hidden_size, p + "mlp."
    shapes = {m + "gate.weight": (spec.num_experts, h)}
    if spec.router_bias:
        shapes[m + "gate.bias"] = (spec.num_experts,)
    if spec.router_score_bias:
        shapes[m + "gate.e_score_correction_bias"] = (spec.num_experts,)
    if spec.shared_expert_intermediate_size:
        si = spec.shared_expert_intermediate_size
        shapes[m + "shared_expert.gate_proj.weight"] = (si, h)
        shapes[m + "shared_expert.up_proj.weight"] = (si, h)
        shapes[m + "shared_expert.down_proj.weight"] = (h, si)
        if spec.shared_expert_gate:
            shapes[m + "shared_expert_gate.weight"] = (1, h)
    return shapes


def dense_mlp_shapes(spec: ModelSpec, p: str) -> Shapes:
    h, di, m = spec.hidden_size, spec.intermediate_size, p + "mlp."
    return {m + "gate_proj.weight": (di, h), m + "up_proj.weight": (di, h), m + "down_proj.weight": (h, di)}
