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

from collections.abc import Mapping
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
# the tiny models' Gated DeltaNet and shared expert (`ferry make-tiny-model`): more value heads than key heads
TINY_GATED_DELTANET = dict(
    shared_expert_intermediate_size=32,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


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
    """Qwen3-Next's MTP layers are counted by `num_nextn_predict_layers` where its config.json says (the published
    one does not: plan/model_config.py's load_model_config then counts the checkpoint's)."""
    fields = _hybrid_fields(cfg, where, sparse_step_moe_layers(cfg, int(cfg["num_hidden_layers"])))
    return dict(fields, mtp_draft_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0))


def qwen3_5_moe_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    fields = _hybrid_fields(cfg, where, (num_experts(cfg) > 0,) * int(cfg["num_hidden_layers"]))
    return dict(
        fields,
        mtp_draft_layers=int(cfg.get("mtp_num_hidden_layers", 0) or 0),
        mtp_dedicated_embeddings=bool(cfg.get("mtp_use_dedicated_embeddings", False)),
    )


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


# ---- GGUF (llama.cpp's `qwen35moe`, as its converter writes Qwen3.5/3.6 MoE) -------------------------------------

GGUF_QWEN35 = "qwen35moe"
GGUF_QWEN3NEXT = "qwen3next"


def _hybrid_gguf_config(a: str, model_type: str, metadata: dict[str, Any], where: str) -> dict[str, Any]:
    """config.json (the flat text model's) from a qwen35moe or qwen3next GGUF's keys (`a.*`): the Gated DeltaNet's
    sizes in `ssm.*` (state_size the key head's width, group_count the key heads, time_step_rank the value heads,
    inner_size all value heads' width), the full-attention layers every `full_attention_interval`-th (llama.cpp's
    default 4, which older qwen3next files leave out), the rotated share of a head as `rope.dimension_count` of
    `key_length`; MTP layers (`nextn_predict_layers`) are counted in block_count, after the decoder's."""

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{a}.{name}", default)
        if value is None:
            raise ConfigError(f"{where}: the GGUF metadata lacks {a}.{name}")
        return value

    head_dim, value_heads = int(key("attention.key_length")), int(key("ssm.time_step_rank"))
    config: dict[str, Any] = dict(
        model_type=model_type,
        num_hidden_layers=int(key("block_count")) - int(key("nextn_predict_layers", 0)),
        max_position_embeddings=int(key("context_length")),
        hidden_size=int(key("embedding_length")),
        num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        num_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")),
        linear_conv_kernel_dim=int(key("ssm.conv_kernel")),
        linear_key_head_dim=int(key("ssm.state_size")),
        linear_num_key_heads=int(key("ssm.group_count")),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=int(key("ssm.inner_size")) // value_heads,
        full_attention_interval=int(key("full_attention_interval", 4)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(key("rope.freq_base")),
            "partial_rotary_factor": int(key("rope.dimension_count")) / head_dim,
        },
    )
    if f"{a}.feed_forward_length" in metadata:
        config["intermediate_size"] = int(metadata[f"{a}.feed_forward_length"])
    return config


def qwen3_5_moe_gguf_config(metadata: dict[str, Any], tensors: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`_hybrid_gguf_config`, and the MTP layer where the file holds it (llama.cpp writes Qwen3.5's as block
    num_hidden_layers: plan/gguf_checkpoint.py's `mtp_gguf_source`), for --speculative-method mtp."""
    config = _hybrid_gguf_config(GGUF_QWEN35, "qwen3_5_moe_text", metadata, where)
    config["mtp_num_hidden_layers"] = _gguf_mtp_layers(GGUF_QWEN35, metadata, tensors, config["num_hidden_layers"])
    return config


def _gguf_mtp_layers(a: str, metadata: dict[str, Any], tensors: Mapping[str, Any], layers: int) -> int:
    """The MTP layers a file holds: `a.nextn_predict_layers` where its first's `nextn.eh_proj` is there (a file
    converted without them, --no-mtp or by an older converter, has none)."""
    nextn = int(metadata.get(f"{a}.nextn_predict_layers") or 0)
    return nextn if nextn and f"blk.{layers}.nextn.eh_proj.weight" in tensors else 0


def qwen3_next_gguf_config(metadata: dict[str, Any], tensors: Mapping[str, Any], where: str) -> dict[str, Any]:
    """As qwen35moe's (its MTP layers too, which llama.cpp's converter writes as Qwen3.5's since it learnt them);
    the layers without routed experts in the file are dense (mlp_only_layers)."""
    from ferry.plan.gguf_checkpoint import GgufNames, moe_layers_of

    config = _hybrid_gguf_config(GGUF_QWEN3NEXT, "qwen3_next", metadata, where)
    layers = config["num_hidden_layers"]
    config["num_nextn_predict_layers"] = _gguf_mtp_layers(GGUF_QWEN3NEXT, metadata, tensors, layers)
    moe = set(moe_layers_of(tensors, layers, GgufNames(GGUF_QWEN3NEXT, layers)))
    config["mlp_only_layers"] = [layer for layer in range(layers) if layer not in moe]
    return config


def qwen3_5_moe_gguf_write_metadata(writer, config: dict) -> None:
    """As llama.cpp's Qwen3.5 MoE converter: its graph places full attention every `full_attention_interval`-th
    layer, so a checkpoint whose layer_types differ has no GGUF; its MTP layers (mtp_num_hidden_layers, where the
    checkpoint holds them) counted in block_count after the decoder's and in nextn_predict_layers."""
    _hybrid_gguf_write_metadata(writer, config, int(config.get("mtp_num_hidden_layers") or 0))
    rope = config.get("rope_parameters") or {}
    writer.add_rope_dimension_sections((list(rope.get("mrope_section", [11, 11, 10])) + [0, 0, 0, 0])[:4])


def qwen3_next_gguf_write_metadata(writer, config: dict) -> None:
    """As llama.cpp's Qwen3-Next converter (its rope has no sections); its table names no dense MLP beside the
    MoE layers' own, so a checkpoint with dense layers has no GGUF."""
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1) or 1) != 1:
        raise ValueError("the GGUF writer takes a qwen3_next checkpoint of MoE layers only")
    _hybrid_gguf_write_metadata(writer, config, int(config.get("num_nextn_predict_layers") or 0))


def _hybrid_gguf_write_metadata(writer, config: dict, nextn: int = 0) -> None:
    layers = int(config["num_hidden_layers"])
    types = config.get("layer_types") or []
    first_full = types.index("full_attention") + 1 if "full_attention" in types else 4
    interval = int(config.get("full_attention_interval", first_full))
    periodic = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if config.get("layer_types", periodic) != periodic:
        raise ValueError(f"the GGUF writer takes a hybrid checkpoint with full attention every {interval}th layer")
    rope = config.get("rope_parameters") or {}
    rotated = config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    value_heads = int(config["linear_num_value_heads"])
    writer.add_block_count(layers + nextn)
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(value_heads)
    writer.add_ssm_inner_size(int(config["linear_value_head_dim"]) * value_heads)
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(int(int(config["head_dim"]) * rotated))


def _shifted_norm(name: str) -> bool:
    """llama.cpp stores the zero-centred RMSNorms' weights as 1 + w (its graph scales by the weight as stored); the
    Gated DeltaNet's output norm is a plain one, stored as is."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")


def _value_head_axis(spec: ModelSpec, name: str) -> tuple[int, int, int] | None:
    """(axis, first index, width of a head) of the value heads in a Gated DeltaNet tensor: the checkpoint groups
    them by key head (head g r + j, r value heads a key head), llama.cpp's converter tiles them (head j nk + g)."""
    p = name.rsplit("linear_attn.", 1)[-1] if "linear_attn." in name else ""
    width, qk = spec.linear_value_head_dim, 2 * spec.linear_key_dim
    return {
        "in_proj_qkv.weight": (0, qk, width),
        "conv1d.weight": (0, qk, width),
        "in_proj_z.weight": (0, 0, width),
        "in_proj_b.weight": (0, 0, 1),
        "in_proj_a.weight": (0, 0, 1),
        "A_log": (0, 0, 1),
        "dt_bias": (0, 0, 1),
        "out_proj.weight": (1, 0, width),
    }.get(p)


def _reorder_value_heads(spec: ModelSpec, name: str, values, tiled: bool):
    """The value heads of `values` from the checkpoint's grouped order to llama.cpp's tiled one (`tiled`), or back."""
    import numpy as np

    where = _value_head_axis(spec, name)
    nk, nv = spec.linear_num_key_heads, spec.linear_num_value_heads
    if where is None or nk == nv:
        return values
    axis, start, width = where
    x = np.moveaxis(values, axis, 0)
    heads = x[start:]
    order = (nk, nv // nk) if tiled else (nv // nk, nk)
    heads = heads.reshape(*order, width, *heads.shape[1:]).swapaxes(0, 1).reshape(heads.shape)
    return np.moveaxis(np.concatenate([x[:start], heads]), 0, axis)


def qwen3_5_moe_gguf_write_tensor(spec: ModelSpec, name: str, values) -> dict[str, Any]:
    """llama.cpp's converter: the convolution squeezed to [C, K], the value heads tiled, A as -exp(A_log), the
    zero-centred norms' weights shifted by one."""
    import numpy as np

    if name.endswith("linear_attn.conv1d.weight"):
        values = values.squeeze(1)
    values = _reorder_value_heads(spec, name, values, tiled=True)
    if name.endswith("linear_attn.A_log"):
        return {name: -np.exp(values)}
    return {name: values + 1 if _shifted_norm(name) else values}


def _a_log(a):
    """The Gated DeltaNet's A_log from llama.cpp's A = -exp(A_log)."""
    import numpy as np

    return np.log(-a)


def qwen3_5_moe_gguf_read_tensor(spec: ModelSpec, name: str, fetch):
    """`qwen3_5_moe_gguf_write_tensor` undone."""
    values = fetch(name)
    if values is None:
        return None
    if name.endswith("linear_attn.A_log"):
        values = _a_log(values)
    elif _shifted_norm(name):
        values = values - 1
    values = _reorder_value_heads(spec, name, values, tiled=False)
    return values[:, None, :] if name.endswith("linear_attn.conv1d.weight") else values


def _split_qkvz(spec: ModelSpec, values) -> tuple[Any, Any]:
    """qwen3_next's in_proj_qkvz, its rows grouped by key head ([q_g | k_g | v_g | z_g] for each g), as llama.cpp's
    converter splits it: (every q, then every k, then every v; every z)."""
    import numpy as np

    nk, dk = spec.linear_num_key_heads, spec.linear_key_head_dim
    vz = spec.linear_value_dim // nk
    x = values.reshape(nk, 2 * dk + 2 * vz, -1)
    q, k, v, z = x[:, :dk], x[:, dk : 2 * dk], x[:, 2 * dk : 2 * dk + vz], x[:, 2 * dk + vz :]
    cols = values.shape[-1]
    return np.concatenate([t.reshape(-1, cols) for t in (q, k, v)]), z.reshape(-1, cols)


def _joined_qkvz(spec: ModelSpec, qkv, z):
    """`_split_qkvz` undone."""
    import numpy as np

    nk, dk = spec.linear_num_key_heads, spec.linear_key_head_dim
    cols = qkv.shape[-1]
    q, k = qkv[: nk * dk].reshape(nk, dk, cols), qkv[nk * dk : 2 * nk * dk].reshape(nk, dk, cols)
    v, z = qkv[2 * nk * dk :].reshape(nk, -1, cols), z.reshape(nk, -1, cols)
    return np.concatenate([q, k, v, z], axis=1).reshape(-1, cols)


QKVZ = "linear_attn.in_proj_qkvz.weight"


def qwen3_next_gguf_write_tensor(spec: ModelSpec, name: str, values) -> dict[str, Any]:
    """llama.cpp's converter (its newer layout): in_proj_qkvz split into attn_qkv and attn_gate, in_proj_ba as it
    is; the convolution squeezed, A as -exp(A_log), the zero-centred norms shifted by one (no value-head order)."""
    import numpy as np

    if name.endswith(QKVZ):
        qkv, z = _split_qkvz(spec, values)
        return {
            name.replace(QKVZ, "linear_attn.in_proj_qkv.weight"): qkv,
            name.replace(QKVZ, "linear_attn.in_proj_z.weight"): z,
        }
    if name.endswith("linear_attn.conv1d.weight"):
        return {name: values.squeeze(1)}
    if name.endswith("linear_attn.A_log"):
        return {name: -np.exp(values)}
    return {name: values + 1 if _shifted_norm(name) else values}


def qwen3_next_gguf_read_tensor(spec: ModelSpec, name: str, fetch):
    """`qwen3_next_gguf_write_tensor` undone; in_proj_qkvz read whole where the file holds it so (`ssm_in`: the
    converter's first layout)."""
    if name.endswith(QKVZ):
        whole = fetch(name)
        if whole is not None:
            return whole
        qkv = fetch(name.replace(QKVZ, "linear_attn.in_proj_qkv.weight"))
        z = fetch(name.replace(QKVZ, "linear_attn.in_proj_z.weight"))
        return None if qkv is None or z is None else _joined_qkvz(spec, qkv, z)
    values = fetch(name)
    if values is None:
        return None
    if name.endswith("linear_attn.A_log"):
        return _a_log(values)
    if name.endswith("linear_attn.conv1d.weight"):
        return values[:, None, :]
    return values - 1 if _shifted_norm(name) else values


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
        # a linear-attention layer, then a full one, every layer MoE; more value heads than key heads
        tiny_config=dict(
            TINY_GATED_DELTANET,
            num_hidden_layers=2,
            full_attention_interval=2,
            intermediate_size=48,
            partial_rotary_factor=0.25,
            norm_topk_prob=True,
        ),
        reference_classes=("Qwen3NextConfig", "Qwen3NextForCausalLM"),
        gguf_architectures=(GGUF_QWEN3NEXT,),
        gguf_config=qwen3_next_gguf_config,
        gguf_write_metadata=qwen3_next_gguf_write_metadata,
        gguf_write_tensor=qwen3_next_gguf_write_tensor,
        gguf_read_tensor=qwen3_next_gguf_read_tensor,
        mtp_config_key="num_nextn_predict_layers",
        gguf_mtp=True,
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
            TINY_GATED_DELTANET,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
        reference_classes=("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
        gguf_architectures=(GGUF_QWEN35,),
        gguf_config=qwen3_5_moe_gguf_config,
        gguf_write_metadata=qwen3_5_moe_gguf_write_metadata,
        gguf_write_tensor=qwen3_5_moe_gguf_write_tensor,
        gguf_read_tensor=qwen3_5_moe_gguf_read_tensor,
        mtp_config_key="mtp_num_hidden_layers",
        gguf_mtp=True,
    )
)
