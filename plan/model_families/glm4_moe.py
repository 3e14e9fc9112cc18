"""glm4_moe (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7): full attention in every layer, a routed MoE block with
an always-on shared expert after the first `first_k_dense_replace` dense layers, plain RMSNorms.

What it computes differently from qwen3_moe, each a generic ModelSpec field:
  * the router scores experts by sigmoid (not softmax), adds the per-expert `e_score_correction_bias` for
    choosing only (the weights are the unbiased scores), chooses among the `topk_group` of `n_group` expert
    groups whose two best scores sum highest, renormalises (`norm_topk_prob`) and scales the weights by
    `routed_scaling_factor`;
  * `n_shared_experts` shared experts are one dense MLP of `moe_intermediate_size * n_shared_experts`, added
    without a gate (checkpoint name `mlp.shared_experts.`);
  * attention has q/k/v biases where `attention_bias` (o_proj never), q/k RMSNorms only where `use_qk_norm`,
    and rotates the first `partial_rotary_factor` (default 0.5) of each head, half-split (rotate_half) as
    transformers' Glm4MoeAttention does;
  * experts are counted by `n_routed_experts`.
The checkpoints append `num_nextn_predict_layers` multi-token-prediction (NextN) layers after the decoder's
(`model.layers.46.…` in GLM-4.5-Air): the target skips them (`ModelSpec.mtp_layers`), and --speculative-method mtp
drafts with the first (`ModelSpec.mtp_draft_layers`), read as plan/mtp_layer.py names the MTP tensors
(`mtp_renames`: its `eh_proj`, `enorm`, `hnorm` and `shared_head.norm` are Qwen's `fc`, `pre_fc_norm_embedding`,
`pre_fc_norm_hidden` and `norm`, in the same places of the same computation, as vLLM's and SGLang's GLM MTP
modules compute them).
The worker's half: services/worker/models/glm4_moe.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferry.plan.model_families import ModelFamily, register
from ferry.plan.model_families.spec_fields import attention_fields, first, mlp_fields, require
from ferry.plan.model_families.weight_shapes import attention_shapes, decoder_shapes
from ferry.plan.model_spec import FULL_ATTENTION, ModelSpec
from ferry.shared.errors import ConfigError

# the shared expert's name in GLM's checkpoints; Ferry's MoE block (and weight_shapes) call it `shared_expert.`
SHARED_EXPERTS = ".mlp.shared_experts."
SHARED_EXPERT = ".mlp.shared_expert."
# a NextN layer's own input projection and norms -> the `mtp.` names of the same tensors (plan/mtp_layer.py)
NEXTN_OWN = {
    "eh_proj.": "mtp.fc.",
    "enorm.": "mtp.pre_fc_norm_embedding.",
    "hnorm.": "mtp.pre_fc_norm_hidden.",
    "shared_head.norm.": "mtp.norm.",
}


def spec_fields(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    num_layers = int(require(cfg, "num_hidden_layers", where))
    nextn = int(first(cfg, "num_nextn_predict_layers", "num_mtp_layers", default=0))
    experts = int(first(cfg, "n_routed_experts", "num_local_experts", "num_experts", default=0))
    dense_first = int(first(cfg, "first_k_dense_replace", default=1))
    attention = attention_fields(cfg, where, partial_rotary_factor=0.5, output_gate=False)
    mlp = mlp_fields(cfg, norm_topk_prob=True, shared_expert=False)
    moe_intermediate = mlp["moe_intermediate_size"]
    return dict(
        layer_types=(FULL_ATTENTION,) * num_layers,
        moe_layers=tuple(experts > 0 and i >= dense_first for i in range(num_layers)),
        **dict(attention, attention_output_bias=False, qk_norm=bool(cfg.get("use_qk_norm", False))),
        **dict(
            mlp,
            num_experts=experts,
            shared_expert_intermediate_size=moe_intermediate * int(first(cfg, "n_shared_experts", default=1)),
        ),
        shared_expert_gate=False,
        router_scoring="sigmoid",
        router_score_bias=True,
        router_groups=int(first(cfg, "n_group", default=1)),
        router_topk_groups=int(first(cfg, "topk_group", default=1)),
        routed_scaling_factor=float(first(cfg, "routed_scaling_factor", default=1.0)),
        mtp_layers=nextn,
        mtp_draft_layers=nextn,
    )


def mtp_renames(spec: ModelSpec) -> tuple[tuple[str, str | None], ...]:
    """Where the checkpoints hold the MTP tensors (plan/mtp_layer.py): NextN layer i is decoder layer num_layers + i,
    its decoder tensors those of `mtp.layers.i.`, the shared expert under GLM's name. Its embedding table and head
    (`embed_tokens`, `shared_head.head`) are copies of the target's, which the head uses (vLLM shares them too).
    Each layer has its own input projection and norms, where Qwen's layers share one: the first layer's are read,
    the one the drafts chain through (services/worker/mtp_drafts.py)."""
    renames: list[tuple[str, str | None]] = []
    for i in range(spec.mtp_draft_layers):
        layer = f"model.layers.{spec.num_layers + i}."
        renames += [(layer + "embed_tokens.", None), (layer + "shared_head.head.", None)]
        renames += [(layer + own, name if i == 0 else None) for own, name in NEXTN_OWN.items()]
        renames += [
            (layer + SHARED_EXPERTS.removeprefix("."), f"mtp.layers.{i}{SHARED_EXPERT}"),
            (layer, f"mtp.layers.{i}."),
        ]
    return tuple(renames)


GGUF_ARCHITECTURE = "glm4moe"
# {glm4moe.KEY: config.json field} as llama.cpp's converter (Glm4MoeModel) writes them; transformers' GGUF tables
# have no glm4_moe
GGUF_FIELDS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "expert_count": "n_routed_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_count": "n_shared_experts",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",
    "leading_dense_block_count": "first_k_dense_replace",
    "nextn_predict_layers": "num_nextn_predict_layers",
}
GGUF_REQUIRED = (
    "block_count",
    "embedding_length",
    "attention.head_count",
    "expert_count",
    "expert_feed_forward_length",
)
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID: GLM's router


def gguf_config(metadata: dict[str, Any], tensors: Mapping[str, Any], where: str) -> dict[str, Any]:
    """config.json from a glm4moe GGUF. llama.cpp's block_count counts the NextN (MTP) layers appended after the
    decoder's, so num_hidden_layers is block_count less nextn_predict_layers (their blk.N tensors are read by
    --speculative-method mtp alone, as the checkpoint's model.layers.N ones are); the rotated share of a head is
    rope.dimension_count / key_length; the q/k/v biases and q/k norms are there where their tensors are."""

    def key(name: str) -> Any:
        return metadata.get(f"{GGUF_ARCHITECTURE}.{name}")

    missing = [f"{GGUF_ARCHITECTURE}.{k}" for k in GGUF_REQUIRED if key(k) is None]
    if missing:
        raise ConfigError(f"{where}: the GGUF metadata lacks {', '.join(missing)}")
    gating = key("expert_gating_func")
    if gating is not None and int(gating) != SIGMOID_GATING:
        raise ConfigError(
            f"{where}: {GGUF_ARCHITECTURE}.expert_gating_func is {gating}; GLM's router scores by sigmoid "
            f"({SIGMOID_GATING}), the only one the glm4_moe family computes"
        )
    config: dict[str, Any] = {field: key(k) for k, field in GGUF_FIELDS.items() if key(k) is not None}
    config["model_type"] = "glm4_moe"
    config["architectures"] = ["Glm4MoeForCausalLM"]
    config.setdefault("num_nextn_predict_layers", 0)
    config["num_hidden_layers"] = int(key("block_count")) - int(config["num_nextn_predict_layers"])
    config.setdefault("head_dim", int(config["hidden_size"]) // int(config["num_attention_heads"]))
    rotated = key("rope.dimension_count")
    config["partial_rotary_factor"] = int(rotated) / int(config["head_dim"]) if rotated is not None else 0.5
    config["norm_topk_prob"] = bool(config.get("norm_topk_prob", True))
    config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors
    if "first_k_dense_replace" not in config:  # the first layer with routed experts
        layers = int(config["num_hidden_layers"])
        config["first_k_dense_replace"] = next(
            (i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in tensors), layers
        )
    return config


def checkpoint_name(name: str) -> str:
    """A name as weight_shapes writes it -> as GLM's checkpoints store it."""
    return name.replace(SHARED_EXPERT, SHARED_EXPERTS)


def resident_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    shapes = decoder_shapes(spec, {FULL_ATTENTION: attention_shapes})
    return {checkpoint_name(name): shape for name, shape in shapes.items()}


def gguf_write_metadata(writer, config: dict) -> None:
    """As llama.cpp's Glm4MoeModel: block_count counts the NextN layers, rope.dimension_count the rotated width."""
    import gguf

    nextn = int(config.get("num_nextn_predict_layers", 0))
    writer.add_block_count(config["num_hidden_layers"] + nextn)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_rope_dimension_count(int(config["head_dim"] * config.get("partial_rotary_factor", 0.5)))
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    writer.add_expert_group_count(config.get("n_group", 1))
    writer.add_expert_group_used_count(config.get("topk_group", 1))
    writer.add_nextn_predict_layers(nextn)


register(
    ModelFamily(
        name="glm4_moe",
        model_types=("glm4_moe",),
        architectures=("Glm4MoeForCausalLM",),
        spec_fields=spec_fields,
        resident_weight_shapes=resident_weight_shapes,
        # a dense first layer, two expert groups of which the top k come from one, q/k/v biases, half of
        # each head rotated, routed weights scaled
        tiny_config=dict(
            num_hidden_layers=3,
            intermediate_size=128,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            attention_bias=True,
            partial_rotary_factor=0.5,
            norm_topk_prob=True,
            rope_theta=10000.0,
            num_nextn_predict_layers=0,
        ),
        reference_classes=("Glm4MoeConfig", "Glm4MoeForCausalLM"),
        gguf_architectures=(GGUF_ARCHITECTURE,),
        gguf_config=gguf_config,
        gguf_write_metadata=gguf_write_metadata,
        mtp_config_key="num_nextn_predict_layers",
        mtp_renames=mtp_renames,
        gguf_mtp=True,
    )
)
