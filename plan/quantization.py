"""A checkpoint's quantization, read from `config.json`'s `quantization_config` (or `hf_quant_config.json`).

These layouts are served (docs/ARCHITECTURE.md §3, "Expert formats"):

* **modelopt** (nvidia's `*-NVFP4` releases): `quant_method: modelopt`, `quant_algo: NVFP4`, or
  `MIXED_PRECISION` with a `quantized_layers` map that gives each module (or the experts' parent,
  `layers.N.mlp.experts`) its own algorithm (`NVFP4` / `W4A16_NVFP4`, or `FP8` per tensor). Per linear: `weight` uint8
  [O, IN/2], `weight_scale` float8 [O, IN/16], `weight_scale_2` fp32, `input_scale` fp32 (unused: activations stay
  bf16). `exclude_modules` (globs) stay bf16.
* **compressed-tensors** NVFP4 (`format: nvfp4-pack-quantized`): `weight_packed`, `weight_scale`,
  `weight_global_scale` (the weight is code x scale / global scale), `ignore` (names or `re:`
  patterns) stays bf16.
* **gguf** (a GGUF file: plan/gguf_checkpoint.py writes `{quant_method: gguf, ggml_type}` for its routed
  experts' one block type, or `ggml_type: mixed` with `expert_types` [[w13 type, w2 type] per MoE layer] for
  several): the experts stay in the file's blocks, held by the format claiming ("gguf", type).
* **fp8** block (Qwen's `-FP8` releases): `quant_method: fp8`, `fmt: e4m3`, `weight_block_size:
  [128, 128]`: `weight` float8_e4m3fn with `weight_scale_inv` [ceil(O/128), ceil(IN/128)]
  (multiplied); `modules_to_not_convert`, and any linear the checkpoint stores without a scale,
  stay bf16.
* **mxfp4** (openai's gpt-oss releases): `quant_method: mxfp4`, e2m1 codes in `*_blocks` uint8 [O, IN/32, 16]
  with e8m0 scales of 32 inputs in `*_scales` uint8 [O, IN/32] (plan/expert_formats/mxfp4.py);
  `modules_to_not_convert` (names or globs) stay bf16.

Anything else is refused here, when the config is read (so `ferry plan` refuses it too, before a
byte is loaded), by a ConfigError naming what was found and what is supported. What this module
decides is the *expert format*: how the routed experts are held in host RAM, in their slots and
across PCIe (plan/expert_formats/). Which dense linear is quantized is decided by the tensors
the checkpoint holds (services/worker/quantized_weight.py); dense weights are dequantized once at
load. No torch here.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from ferry.plan.expert_formats import registry
from ferry.plan.expert_formats.fp8_block import FP8_BLOCKS
from ferry.plan.expert_formats.gguf_blocks import GGUF_METHOD as GGUF
from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.mxfp4 import BLOCKS_SUFFIX, MXFP4_METHOD, SCALES_SUFFIX
from ferry.shared.errors import ConfigError

# The tensors beside a quantized linear's weight, by their last name component (the checkpoints'
# names): its codes' other name, its scales, and what is read and dropped (activation and KV-cache
# scales: Ferry keeps activations and the KV cache in the run dtype). One list for the planner's
# pricing (plan/costs.py) and the loader's grouping (services/worker/quantized_weight.py).
# weight_packed: compressed-tensors' nvfp4 codes; weight_blocks: mxfp4's (both: a module with them is quantized)
CODE_SUFFIXES = ("weight_packed", BLOCKS_SUFFIX)
WEIGHT_SUFFIXES = ("weight", *CODE_SUFFIXES)
SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "weight_scale_inv", "weight_global_scale", SCALES_SUFFIX)
DROPPED_SUFFIXES = ("input_scale", "input_global_scale", "k_scale", "v_scale", "weight_zero_point")
QUANT_SUFFIXES = (*SCALE_SUFFIXES, *DROPPED_SUFFIXES, *CODE_SUFFIXES)

SUPPORTED = (
    "modelopt (quant_algo NVFP4, or MIXED_PRECISION of NVFP4 and FP8 layers), "
    "compressed-tensors (format nvfp4-pack-quantized), fp8 (fmt e4m3, weight_block_size [128, 128]), mxfp4, "
    "and GGUF files"
)

# The module names a routed expert's projections have in the checkpoints (with any wrapper prefix).
_EXPERT_PREFIXES = ("model.layers", "model.language_model.layers", "language_model.model.layers", "layers")


@dataclass(frozen=True)
class QuantScheme:
    """What the checkpoint says about its quantization (the parts Ferry acts on)."""

    method: str  # modelopt | compressed-tensors | fp8 | mxfp4
    algo: str  # NVFP4 | MIXED_PRECISION | nvfp4-pack-quantized | FP8_BLOCKS | mxfp4 (the method is the scheme)
    expert_format: str | None  # the routed experts' format (plan/expert_formats); None: not quantized
    source: str  # where it was read: config.json or hf_quant_config.json
    kv_cache_quant_algo: str | None = None  # noted, not applied: the KV pool stays in the run dtype
    # a GGUF file whose experts mix ggml types: (w13's type, w2's) per MoE layer (plan/expert_formats/gguf_mixed.py)
    expert_types: tuple[tuple[str, str], ...] = ()


def parse_quantization(
    raw: dict[str, Any],
    hf_quant_config: dict[str, Any] | None = None,
    where: str = "config.json",
    experts_module: str = "mlp.experts",
) -> QuantScheme | None:
    """The checkpoint's QuantScheme, None for an unquantized one; a ConfigError for what is not served.
    `experts_module`: where a layer's routed experts sit (the family's `ModelFamily.experts_module`), which
    decides whether the config's exclusions leave them quantized."""
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    source = where
    if qc is None and hf_quant_config is not None:
        qc = {"quant_method": "modelopt", **(hf_quant_config.get("quantization") or {})}
        source = "hf_quant_config.json"
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: quantization_config must be an object")
    method = str(qc.get("quant_method", "")).lower()
    experts = expert_module_names(module=experts_module)
    if method == "modelopt":
        return _modelopt(qc, source, experts)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source, experts)
    if method == "fp8":
        return _fp8(qc, source, experts)
    if method == GGUF:
        return _gguf(qc, source)
    if method == MXFP4_METHOD:
        return _mxfp4(qc, source, experts)
    raise ConfigError(
        f"{source}: quantization_config quant_method {qc.get('quant_method')!r} is not supported; "
        f"Ferry serves {SUPPORTED}, or unquantized checkpoints"
    )


def expert_module_names(layer: int = 0, expert: int = 0, module: str = "mlp.experts") -> list[str]:
    """The names one routed expert's projections may have in a checkpoint or a quantization config, the layer's
    experts at `module` (`mlp.experts`; Gemma 4's beside its dense MLP: `experts`)."""
    return [
        f"{p}.{layer}.{module}.{expert}.{proj}"
        for p in _EXPERT_PREFIXES
        for proj in ("gate_proj", "up_proj", "down_proj")
    ]


def _unsupported_algo(source: str, algo: Any, what: str = "quant_algo") -> ConfigError:
    return ConfigError(f"{source}: modelopt {what} {algo!r} is not supported; Ferry serves {SUPPORTED}")


def _expert_format(method: str, algo: str) -> str:
    """The expert format (plan/expert_formats) that holds routed experts quantized with `algo` under `method`."""
    fmt = registry.for_checkpoint(method, algo)
    if fmt is None:
        raise ConfigError(f"quant_method {method} quant_algo {algo}: no expert format holds such routed experts")
    return fmt.name


# W4A16_NVFP4: the same tensors as NVFP4, with activations left unquantized (how Ferry runs NVFP4 anyway)
_MODELOPT_ALIASES = {"W4A16_NVFP4": "NVFP4"}


def _modelopt(qc: dict[str, Any], source: str, experts: list[str]) -> QuantScheme:
    algo = str(qc.get("quant_algo", "")).upper()
    algo = _MODELOPT_ALIASES.get(algo, algo)
    kv = qc.get("kv_cache_quant_algo")
    if algo == "NVFP4":
        group = int(qc.get("group_size", 16) or 16)
        if group != 16:
            raise ConfigError(f"{source}: modelopt NVFP4 group_size {group} is not supported (only 16)")
        excluded = [str(p) for p in qc.get("exclude_modules") or qc.get("ignore") or []]
        experts_excluded = any(_glob_any(excluded, n) for n in experts)
        return QuantScheme(
            "modelopt", "NVFP4", None if experts_excluded else _expert_format("modelopt", algo), source, kv
        )
    if algo == "MIXED_PRECISION":
        layers = qc.get("quantized_layers")
        if not isinstance(layers, dict):
            raise ConfigError(f"{source}: modelopt MIXED_PRECISION needs a 'quantized_layers' object")
        algos = set()
        for name, entry in layers.items():
            layer_algo = str((entry or {}).get("quant_algo", "")).upper() if isinstance(entry, dict) else ""
            layer_algo = _MODELOPT_ALIASES.get(layer_algo, layer_algo)
            if layer_algo not in ("NVFP4", "FP8"):
                raise _unsupported_algo(source, layer_algo, f"quantized_layers[{name!r}].quant_algo")
            if layer_algo == "NVFP4" and int(entry.get("group_size", 16) or 16) != 16:
                raise ConfigError(f"{source}: quantized_layers[{name!r}]: NVFP4 group_size must be 16")
            if ".mlp.experts" in name:  # the experts' parent (`layers.N.mlp.experts`) or each of them
                algos.add(layer_algo)
        if len(algos) > 1:
            raise ConfigError(
                f"{source}: the routed experts mix {sorted(algos)} in quantized_layers; Ferry holds "
                "every routed expert in one format"
            )
        expert_format = _expert_format("modelopt", algos.pop()) if algos else None
        return QuantScheme("modelopt", "MIXED_PRECISION", expert_format, source, kv)
    raise _unsupported_algo(source, qc.get("quant_algo"))


def _compressed_tensors(qc: dict[str, Any], source: str, experts: list[str]) -> QuantScheme:
    fmt = str(qc.get("format", ""))
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{source}: compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        group_fmt = str((group or {}).get("format") or fmt)
        nvfp4 = (
            weights.get("num_bits") == 4
            and weights.get("type") == "float"
            and weights.get("strategy") == "tensor_group"
            and int(weights.get("group_size") or 0) == 16
        )
        if group_fmt != "nvfp4-pack-quantized" or not nvfp4:
            raise ConfigError(
                f"{source}: compressed-tensors config_groups[{name!r}] (format {group_fmt!r}, weights "
                f"{weights.get('num_bits')}-bit {weights.get('type')} {weights.get('strategy')}) is not "
                f"supported; Ferry serves {SUPPORTED}"
            )
    ignored = [str(p) for p in qc.get("ignore") or []]
    experts_ignored = any(_ct_ignored(p, n) for p in ignored for n in experts)
    algo = "nvfp4-pack-quantized"
    return QuantScheme(
        "compressed-tensors", algo, None if experts_ignored else _expert_format("compressed-tensors", algo), source
    )


def _fp8(qc: dict[str, Any], source: str, experts: list[str]) -> QuantScheme:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    block = qc.get("weight_block_size")
    if fmt != "e4m3" or list(block or []) != [128, 128]:
        raise ConfigError(
            f"{source}: fp8 quantization_config with fmt {fmt!r} and weight_block_size {block!r} is not "
            f"supported; Ferry serves {SUPPORTED}"
        )
    skipped = [str(m) for m in qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []]
    experts_skipped = any(_module_listed(m, n) for m in skipped for n in experts)
    return QuantScheme("fp8", FP8_BLOCKS, None if experts_skipped else _expert_format("fp8", FP8_BLOCKS), source)


def _gguf(qc: dict[str, Any], source: str) -> QuantScheme:
    """A GGUF file's routed experts in one ggml block type, or with `expert_types` ([w13 type, w2 type] per MoE
    layer) in several (plan/gguf_checkpoint.py writes this config)."""
    ggml_type = str(qc.get("ggml_type", ""))
    layers = qc.get("expert_types", [])
    if not isinstance(layers, list) or any(not isinstance(p, list | tuple) or len(p) != 2 for p in layers):
        raise ConfigError(f"{source}: quantization_config expert_types must list [w13 type, w2 type] per MoE layer")
    expert_types = tuple((str(t13), str(t2)) for t13, t2 in layers)
    block_types = {
        algo
        for f in registry.registered()
        if isinstance(f, GgufBlockFormat)
        for method, algo in f.checkpoint_algos
        if method == GGUF
    }
    fmt = registry.for_checkpoint(GGUF, ggml_type)
    unheld = ([] if fmt is not None else [ggml_type]) + sorted({t for p in expert_types for t in p} - block_types)
    if unheld:
        raise ConfigError(
            f"{source}: the routed experts are ggml type {unheld[0]!r}, which no expert format holds; Ferry serves "
            f"GGUF experts in {', '.join(sorted(block_types))} (or F32/F16/BF16)"
        )
    return QuantScheme(GGUF, ggml_type, fmt.name, source, None, expert_types)


def _mxfp4(qc: dict[str, Any], source: str, experts: list[str]) -> QuantScheme:
    skipped = [str(m) for m in qc.get("modules_to_not_convert") or []]
    experts_skipped = any(_glob_any(skipped, n) or any(_module_listed(m, n) for m in skipped) for n in experts)
    expert_format = None if experts_skipped else _expert_format(MXFP4_METHOD, MXFP4_METHOD)
    return QuantScheme(MXFP4_METHOD, MXFP4_METHOD, expert_format, source)


def _glob_any(patterns: list[str], name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns)


def _ct_ignored(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _module_listed(entry: str, name: str) -> bool:
    """fp8's modules_to_not_convert: whole dotted components of the module's name."""
    return f".{entry}." in f".{name}."
