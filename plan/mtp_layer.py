"""The multi-token-prediction (MTP) draft layers of Qwen3.5/3.6, Qwen3-Next and GLM-4.x, torch-free: their
tensors by name and shape, where each family's checkpoints store them, and what they cost on the GPU. The worker's
half: services/worker/models/mtp_head.py.

Ferry names them as Qwen's checkpoints store them, under `mtp.` (beside, not inside, the text model's `model.…`):
`mtp.fc.weight` [H, 2H], the norms `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden` and `mtp.norm` (as the
target's norms, zero-centred or not), and `spec.mtp_draft_layers` full-attention MoE decoder layers `mtp.layers.N.…`
named as the target's full-attention layers are, their routed experts per expert
(`mlp.experts.E.{gate,up,down}_proj.weight`) or fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]). They share the target's embedding table and head (unless `mtp_dedicated_embeddings`, which Ferry
refuses: no published checkpoint has one). GLM's checkpoints store the same layer as decoder layer num_layers
(`model.layers.46.` in GLM-4.5-Air: `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`, then the decoder layer's own
tensors) with copies of the target's embedding table and head (`embed_tokens`, `shared_head.head`) that are not
read: the family's `mtp_renames` say where each lives (`mtp_name`, `mtp_checkpoint_name`).

Their routed experts are GPU-resident, not in the target's expert slot cache: a draft runs every step for every
drafting request over one layer, so its experts would never leave the slots anyway, and keeping them out leaves the
target's slot count and expert indexing as they are. So `mtp_resident_bytes` prices all of them. No torch here."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from ferry.plan.costs import ALLOC_GRANULE, read_safetensors_header, shapes_bytes
from ferry.plan.dtypes import DTYPE_BYTES
from ferry.plan.model_families import family_of
from ferry.plan.model_families.weight_shapes import Shapes, attention_shapes, moe_shapes
from ferry.plan.model_spec import ModelSpec
from ferry.shared.errors import ConfigError
from ferry.shared.speculation import SPECULATIVE_METHODS
from ferry.shared.units import round_up

MTP_PREFIX = "mtp."


def check_mtp(spec: ModelSpec) -> None:
    """A ConfigError naming the flag or config field when this model has no MTP layer Ferry can draft with."""
    if not spec.mtp_draft_layers:
        raise ConfigError(
            f"--speculative-method mtp: this model ({spec.arch}) has no multi-token-prediction layer "
            "(config.json mtp_num_hidden_layers / num_nextn_predict_layers); use --speculative-method ngram"
        )
    if spec.mtp_dedicated_embeddings:
        raise ConfigError("config.json: mtp_use_dedicated_embeddings=true is not supported (shared embeddings only)")


def drafting_spec(spec: ModelSpec) -> ModelSpec:
    """The spec of a model served with `--speculative-method mtp`: its MTP layers' K/V in the KV pool
    (ModelSpec.mtp_kv_layers, plan/kv_groups.py), so the plan prices what the worker allocates; a ConfigError
    naming the flag where the model has none (check_mtp)."""
    check_mtp(spec)
    # the drafts chain through the first MTP layer at every step (services/worker/mtp_drafts.py; the published
    # checkpoints have one): its K/V alone are kept
    return dataclasses.replace(spec, mtp_kv_layers=1)


def spec_for_method(spec: ModelSpec, speculative_method: str | None) -> ModelSpec:
    """The spec the plan and the pools are made for under --speculative-method (None: off): `drafting_spec` with
    mtp, the model's own otherwise; a ConfigError naming the flag for a method that is none of them."""
    if speculative_method is not None and speculative_method not in SPECULATIVE_METHODS:
        raise ConfigError(
            f"--speculative-method must be one of {', '.join(SPECULATIVE_METHODS)}, got {speculative_method!r}"
        )
    return drafting_spec(spec) if speculative_method == "mtp" else spec


def mtp_renames(spec: ModelSpec) -> tuple[tuple[str, str | None], ...]:
    """(checkpoint prefix, the `mtp.` prefix it stands for or None for a copy of a target tensor), the first match
    deciding: the family's (ModelFamily.mtp_renames), or Qwen's names as they are."""
    renames = family_of(spec).mtp_renames
    return ((MTP_PREFIX, MTP_PREFIX),) if renames is None else renames(spec)


def mtp_name(spec: ModelSpec, checkpoint_name: str) -> str | None:
    """The `mtp.…` name of a checkpoint tensor of the MTP layers; None for any other tensor and for the
    checkpoint's copies of the target's (read from the target: one copy on the GPU)."""
    for source, name in mtp_renames(spec):
        if checkpoint_name.startswith(source):
            return None if name is None else name + checkpoint_name.removeprefix(source)
    return None


def mtp_checkpoint_name(spec: ModelSpec, name: str) -> str:
    """Where the checkpoints of `spec`'s family store MTP tensor `name` (`mtp.…`): `mtp_name`'s inverse."""
    for source, prefix in mtp_renames(spec):
        if prefix is not None and name.startswith(prefix):
            candidate = source + name.removeprefix(prefix)
            if mtp_name(spec, candidate) == name:  # a longer prefix earlier in the table would claim it otherwise
                return candidate
    raise ValueError(f"{name!r} is not an MTP tensor of a {spec.arch} checkpoint")


_MTP_LAYER_NAME = re.compile(r"^mtp\.layers\.(\d+)\.")


def checkpoint_mtp_layers(model_dir: Path) -> int:
    """How many `mtp.layers.N.` layers a safetensors checkpoint holds, from its tensors' names (its index's, else
    its shards' headers): what a config that does not count them (Qwen3-Next's published one) has."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = list(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError):
            return 0  # not an index: the loader names the fault
    else:
        names = [name for shard in sorted(model_dir.glob("*.safetensors")) for name in read_safetensors_header(shard)]
    layers = {int(m[1]) for m in map(_MTP_LAYER_NAME.match, names) if m is not None}
    return len(layers) if layers == set(range(len(layers))) else 0


def mtp_kv_layer(spec: ModelSpec, layer: int) -> int:
    """The KV pool's layer index of MTP layer `layer` (plan/kv_groups.py): numbered on from the decoder's."""
    return spec.num_layers + layer


def mtp_resident_weight_shapes(spec: ModelSpec) -> Shapes:
    """Every MTP tensor but the routed experts, by checkpoint name and shape."""
    h = spec.hidden_size
    shapes: Shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    }
    for i in range(spec.mtp_draft_layers):
        p = f"mtp.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update(attention_shapes(spec, p))
        shapes.update(moe_shapes(spec, p))
    return shapes


def mtp_expert_shapes(spec: ModelSpec) -> Shapes:
    """The MTP layers' routed experts, one tensor a projection and expert (the per-expert layout)."""
    h, i = spec.hidden_size, spec.moe_intermediate_size
    shapes: Shapes = {}
    for layer in range(spec.mtp_draft_layers):
        for e in range(spec.num_experts):
            p = f"mtp.layers.{layer}.mlp.experts.{e}."
            shapes[p + "gate_proj.weight"] = (i, h)
            shapes[p + "up_proj.weight"] = (i, h)
            shapes[p + "down_proj.weight"] = (h, i)
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def mtp_resident_bytes(spec: ModelSpec, dtype: str) -> int:
    """GPU bytes of the MTP layers' weights as the worker allocates them (services/worker/models/mtp_head.py): one
    allocation a tensor of `mtp_resident_weight_shapes`, and each layer's routed experts in two, gate_up
    [E, 2I, H] and down [E, H, I]; each rounded to the CUDA allocator's granule."""
    itemsize = DTYPE_BYTES[dtype]
    total = shapes_bytes(mtp_resident_weight_shapes(spec), dtype)
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    per_layer = round_up(e * 2 * i * h * itemsize, ALLOC_GRANULE) + round_up(e * h * i * itemsize, ALLOC_GRANULE)
    return total + spec.mtp_draft_layers * per_layer


def mtp_kv_bytes_per_token(spec: ModelSpec, dtype: str) -> int:
    """K and V bytes a drafted position takes in the MTP layers' own caches (their attention is full attention
    with the target's head shape, kept in the run dtype)."""
    return spec.mtp_draft_layers * 2 * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[dtype]


@dataclasses.dataclass(frozen=True)
class MtpChainBytes:
    """HBM bytes one step of an MTP draft chain reads (services/worker/mtp_drafts.py's `_chain`), as the scheduler's
    draft-length controller prices a draft (services/scheduler/draft_length.py): weights read once a chain step
    whatever the rows chaining in it (the target's LM head; the MTP layer's dense weights), and the routed experts
    one row's token reads in the layer's MoE (top-k experts: a row of its own reads its own)."""

    lm_head: int  # vocab (or --speculative-draft-vocab) x hidden: each chain step's logits for its draft tokens
    layer: int  # the first MTP layer's weights but its routed experts (fc, norms, attention, router, shared expert)
    row_experts: int  # top-k routed experts of that layer: what one more row's token reads

    @staticmethod
    def of(spec: ModelSpec, dtype: str, draft_vocab: int = 0) -> MtpChainBytes:
        itemsize = DTYPE_BYTES[dtype]
        layer = {
            name: shape
            for name, shape in mtp_resident_weight_shapes(spec).items()
            if not name.startswith(MTP_PREFIX + "layers.") or name.startswith(MTP_PREFIX + "layers.0.")
        }
        h, i = spec.hidden_size, spec.moe_intermediate_size
        return MtpChainBytes(
            lm_head=(draft_vocab or spec.vocab_size) * h * itemsize,  # boot refuses one past the vocabulary
            layer=sum(_numel(s) for s in layer.values()) * itemsize,
            row_experts=min(spec.num_experts_per_tok, spec.num_experts) * 3 * i * h * itemsize,
        )
