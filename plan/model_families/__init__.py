"""The model families Ferry serves, torch-free side: which config.json each claims and how it reads it.

A family is one vertical slice: this module's registry holds its torch-free half (a module of this folder,
one per family or per group that one composition serves), `services/worker/models/` its torch half (the
layer composition and the checkpoint's names), both found by one name, `ModelSpec.arch`. Every module of
this folder is imported once, on the first lookup, so a family registers itself by existing; nothing
outside its two halves names it.

A new family registers, with `register(ModelFamily(...))` in a module of this folder:
  * `name`: the family's name, `ModelSpec.arch` (the worker side registers under the same name);
  * `model_types` and `architectures`: the config.json `model_type` values and `architectures` entries it
    claims (model_type decides; `architectures` where config.json has no model_type);
  * `spec_fields(text_config, where)`: its `ModelSpec` fields, all but those every model has (vocabulary,
    layer count, norm eps, dtype...: plan/model_config.py reads them); spec_fields.py has the shared readers,
    and `text_config(raw, where)` when the text model is nested (a multimodal wrapper's `text_config`);
  * `resident_weight_shapes(spec)`: every GPU-resident tensor by checkpoint name and shape, routed experts
    left out (weight_shapes.py has the shared layer kinds): the planner's weight bytes and dummy weights;
  * `published_names(config)`, when its published checkpoints name tensors other than `model.…`;
  * `experts_module`, when a layer's routed experts are not at `layers.N.mlp.experts` (Gemma 4's `experts`);
  * `tiny_config` and `reference_classes`, for `ferry make-tiny-model` (transformers' classes write it);
  * `chat_format`, when its models speak another chat format than their Jinja chat template ("harmony":
    gpt-oss; the api's `--chat-format auto` takes it: services/api/tokenizer.py);
  * `tool_call_parser` / `reasoning_parser`, when its models write calls or reasoning in another markup than
    Qwen's (Gemma 4's; the api's `--tool-call-parser auto` / `--reasoning-parser auto` take them);
  * `gguf_architectures` and `gguf_config(metadata, tensors, where)`, where it serves GGUF files: the
    `general.architecture` values it claims and their metadata (and tensor table) as config.json fields
    (plan/gguf_checkpoint.py).
  * `mtp_config_key` (and `mtp_renames` where its checkpoints do not store them under `mtp.`), where its models
    have multi-token-prediction layers --speculative-method mtp drafts with (plan/mtp_layer.py).
and, on the worker side, its module in `services/worker/models/` (that package's registry.py says what).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ferry.plan.model_spec import ModelSpec
from ferry.shared.errors import ConfigError


def _flat(raw: dict[str, Any], where: str) -> dict[str, Any]:
    return raw


def _same_names(config: dict[str, Any]) -> Callable[[str], str]:
    return lambda name: name


@dataclass(frozen=True, eq=False)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    # the text model's config -> the family's ModelSpec fields (all but the shared ones model_config reads)
    spec_fields: Callable[[dict[str, Any], str], dict[str, Any]]
    # {checkpoint name: shape} of every GPU-resident tensor (routed experts excluded)
    resident_weight_shapes: Callable[[ModelSpec], dict[str, tuple[int, ...]]]
    # config.json -> the text model's config (a multimodal wrapper nests it)
    text_config: Callable[[dict[str, Any], str], dict[str, Any]] = _flat
    # config.json -> (name as Ferry writes it, `model.…` -> name in the published checkpoints)
    published_names: Callable[[dict[str, Any]], Callable[[str], str]] = _same_names
    # `ferry make-tiny-model`: the tiny config's fields and transformers' (config class, model class)
    tiny_config: dict[str, Any] | None = None
    reference_classes: tuple[str, str] | None = None
    # how the api renders a chat and reads the output back: "template" (the tokenizer's chat template and the
    # text parsers) or "harmony" (services/api/harmony_format.py); config.py's CHAT_FORMATS
    chat_format: str = "template"
    # the api's parsers of its output markup (services/api/config.py's TOOL_CALL_PARSERS, REASONING_PARSERS)
    tool_call_parser: str = "qwen"
    reasoning_parser: str = "qwen3"
    # where a layer's routed experts sit under `layers.N.` (a quantization config's exclusions are matched to it)
    experts_module: str = "mlp.experts"
    # GGUF files (plan/gguf_checkpoint.py): the general.architecture values it claims, and
    # (metadata, the file's tensors {GGUF name: GgufTensor}, where) -> config.json's fields
    gguf_architectures: tuple[str, ...] = ()
    gguf_config: Callable[[dict[str, Any], Mapping[str, Any], str], dict[str, Any]] | None = None
    # services/gguf_writer.py (tiny GGUF files for the tests): (gguf.GGUFWriter, config.json) -> the family's own
    # keys as llama.cpp's converter writes them; and where its checkpoint fuses a layer's experts, (tensors,
    # layer, experts) -> ({part: [E, rows, cols]}, {part: biases}) split as that converter splits them
    gguf_write_metadata: Callable[[Any, dict[str, Any]], None] | None = None
    gguf_split_experts: Callable[[dict, int, int], tuple[dict, dict]] | None = None
    # resident tensors whose values llama.cpp's converter changes (a sign, an exponent, a squeezed axis, an order, a
    # split): (spec, Hugging Face name, numpy float32 values) -> {name the gguf package's table maps: values} as it
    # writes them; and the inverse, (spec, name, fetch) -> the checkpoint's values, where fetch(name) gives the
    # float32 values of the file's tensor the table maps `name` to (None where the file has none)
    gguf_write_tensor: Callable[[ModelSpec, str, Any], dict[str, Any]] | None = None
    gguf_read_tensor: Callable[[ModelSpec, str, Callable[[str], Any]], Any] | None = None
    # the config.json key counting its multi-token-prediction layers (plan/mtp_layer.py; what `ferry make-tiny-model
    # --mtp` writes); None: the family has none
    mtp_config_key: str | None = None
    # llama.cpp's converter writes its MTP layers into a GGUF (as blocks after the decoder's: plan/gguf_checkpoint.py's
    # `mtp_gguf_source`); False: it drops them
    gguf_mtp: bool = False
    # where its checkpoints store the MTP tensors plan/mtp_layer.py names `mtp.…`: spec -> ((checkpoint prefix, `mtp.`
    # prefix it stands for, or None for a copy of a target tensor Ferry does not read), ...), the first match
    # deciding; None: under `mtp.` as named there (Qwen's)
    mtp_renames: Callable[[ModelSpec], tuple[tuple[str, str | None], ...]] | None = None


_FAMILIES: dict[str, ModelFamily] = {}
_discovered = False


def register(family: ModelFamily) -> ModelFamily:
    """Add a family; a second one of the same name, or claiming a claimed model_type, is a programming error."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    for other in _FAMILIES.values():
        if taken := set(other.model_types) & set(family.model_types):
            raise ValueError(f"model family {family.name!r} claims model_type {sorted(taken)} of {other.name!r}")
        if taken := set(other.gguf_architectures) & set(family.gguf_architectures):
            raise ValueError(f"model family {family.name!r} claims GGUF architecture {sorted(taken)} of {other.name!r}")
    if bool(family.gguf_architectures) != (family.gguf_config is not None):
        raise ValueError(f"model family {family.name!r}: gguf_architectures and gguf_config go together")
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, ModelFamily]:
    """{name: family} of every registered family."""
    global _discovered
    if not _discovered:
        _discovered = True
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
    return _FAMILIES


def family_of(spec: ModelSpec) -> ModelFamily:
    family = families().get(spec.arch)
    if family is None:
        raise ConfigError(f"model family {spec.arch!r} is not registered; Ferry serves {', '.join(sorted(families()))}")
    return family


def family_for_config(raw: dict[str, Any], where: str = "config.json") -> ModelFamily:
    """The family that claims config.json's `model_type` (one of its `architectures` where it has no
    model_type: a model_type no family claims is another model); a ConfigError naming both when none does."""
    model_type, architectures = raw.get("model_type"), raw.get("architectures")
    for family in families().values():
        if model_type in family.model_types:
            return family
    names = architectures if isinstance(architectures, list) and model_type is None else []
    for family in families().values():
        if any(name in family.architectures for name in names):
            return family
    served = sorted(t for f in families().values() for t in f.model_types)
    raise ConfigError(
        f"{where}: model_type {model_type!r} is not supported (architectures {architectures!r}); "
        f"Ferry serves model_type {', '.join(served)}"
    )


def family_for_gguf(architecture: str, where: str) -> ModelFamily:
    """The family that claims a GGUF file's `general.architecture`; a ConfigError naming it when none does."""
    for family in families().values():
        if architecture in family.gguf_architectures:
            return family
    served = sorted(a for f in families().values() for a in f.gguf_architectures)
    raise ConfigError(
        f"{where}: GGUF architecture {architecture!r} is not served; Ferry serves GGUF architecture {', '.join(served)}"
    )
