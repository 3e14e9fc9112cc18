"""A GGUF checkpoint (llama.cpp's single-file format): where its files are, its metadata, its tensor table,
and the Hugging Face config.json its metadata stands for.

`--model` may be a `.gguf` file, the first file of a split set (`NAME-00001-of-0000N.gguf`, the others
beside it), or a directory holding one model's GGUF file(s) and no config.json. The file is read with the
`gguf` package (llama.cpp's own reader: numpy, memory-mapped, no torch). Everything a config.json says
comes from the metadata: the family that claims the GGUF architecture (`ModelFamily.gguf_architectures`,
plan/model_families/) turns its keys into config.json fields (`ModelFamily.gguf_config`), so a new
family plugs in by its own module; this module adds what every file says the same way (vocabulary size,
tied embeddings, eos ids) and the routed experts' quantization, from their tensors' ggml type:

* one quantized type for every routed expert tensor: `quantization_config {quant_method: gguf, ggml_type}`,
  held by the expert format that claims ("gguf", type) (plan/expert_formats/gguf_*.py, via plan/quantization.py);
* several (llama.cpp's `_M` mixes give ffn_down_exps another type on some layers): `ggml_type: mixed` and
  `expert_types` [[w13 type, w2 type] per MoE layer], held by plan/expert_formats/gguf_mixed.py; a layer's gate
  and up must share a type (one byte row), a file where they differ is refused naming them;
* float experts (F32/F16/BF16): no quantization_config, the experts are loaded as values.

Tensor names are Hugging Face's, mapped to GGUF's by the gguf package's own table (`TensorNameMap`:
`model.layers.3.mlp.experts.gate_proj` <-> `blk.3.ffn_gate_exps`), so the loader and the planner speak
one language. No torch here: `ferry plan model.gguf` runs from this.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ferry.plan.expert_formats.gguf_blocks import GGUF_METHOD
from ferry.plan.expert_formats.gguf_mixed import MIXED_TYPES
from ferry.shared.errors import ConfigError

GGUF_SUFFIX = ".gguf"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# the float types a GGUF stores values (not blocks) in: experts of these are loaded as plain tensors
FLOAT_TYPES = ("F32", "F16", "BF16")
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `--model` names (the first of a split set), or None when it names no GGUF
    (a Hugging Face directory: one holding config.json). A ConfigError naming --model for a split
    file other than the first, or a directory holding several models' GGUF files."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == GGUF_SUFFIX:
        split = _SPLIT.match(path.name)
        if split and int(split["index"]) != 1:
            first = f"{split['stem']}-00001-of-{split['count']}.gguf"
            raise ConfigError(f"--model {model}: a split GGUF is read from its first file: give {path.parent / first}")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob(f"*{GGUF_SUFFIX}"))
    firsts = [f for f in files if not _SPLIT.match(f.name) or int(_SPLIT.match(f.name)["index"]) == 1]
    if not firsts:
        return None
    if len(firsts) > 1:
        raise ConfigError(
            f"--model {model}: the directory holds {len(firsts)} GGUF models "
            f"({', '.join(f.name for f in firsts[:4])}): give the .gguf file itself"
        )
    return firsts[0]


def split_files(first: Path) -> list[Path]:
    """Every file of the set `first` opens (itself alone unless it is `-00001-of-N`); a ConfigError for a
    missing one."""
    split = _SPLIT.match(first.name)
    if not split:
        return [first]
    count = int(split["count"])
    files = [first.parent / f"{split['stem']}-{i:05d}-of-{split['count']}.gguf" for i in range(1, count + 1)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"--model {first}: the split GGUF lacks {', '.join(missing)}")
    return files


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file: its shape in torch order (rows last-but-one), its ggml type's name, and
    its bytes (numpy, memory-mapped: [..., row bytes] for block types, the values for float ones)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    data: Any  # numpy array over the file's mapping

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


class GgufCheckpoint:
    """A GGUF model (one file or a split set): `metadata` {key: value} (the large arrays left out: `value(key)`
    reads them), `tensors` {GGUF name: GgufTensor}, `architecture` (general.architecture)."""

    def __init__(self, first: Path):
        self.path = first
        self.files = split_files(first)
        try:
            self.readers = [_reader_class()(str(f)) for f in self.files]
        except (ValueError, OSError) as exc:
            raise ConfigError(f"--model {first}: not a readable GGUF file ({exc})") from exc
        self._fields = self.readers[0].fields
        self.tensors: dict[str, GgufTensor] = {}
        for reader in self.readers:
            for t in reader.tensors:
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists the fastest dimension first
                self.tensors[t.name] = GgufTensor(t.name, shape, t.tensor_type.name, t.data)
        self.architecture = str(self.value("general.architecture", ""))
        if not self.architecture:
            raise ConfigError(f"{first}: the GGUF metadata has no general.architecture")

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value (a scalar or a list of numbers); `default` when the file does not have it. A float32
        is read as the shortest decimal that is that float32 (1e-06, not 9.99999997e-07): config.json's number."""
        import gguf

        field = self._fields.get(key)
        if field is None:
            return default
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            return float(str(np.float32(field.contents())))
        return field.contents()

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every key but the large arrays (the vocabulary, merges, token types, scores): {key: value}."""
        import gguf

        return {
            k: self.value(k)
            for k, f in self._fields.items()
            if not k.startswith("GGUF.") and (f.types[:1] != [gguf.GGUFValueType.ARRAY] or len(f.data) <= 1024)
        }

    def array_length(self, key: str) -> int:
        field = self._fields.get(key)
        return 0 if field is None else len(field.data)

    def names(self) -> GgufNames:
        return GgufNames(self.architecture, int(self.value(f"{self.architecture}.block_count", 0)))


@lru_cache(maxsize=1)
def _reader_class() -> type:
    """gguf's reader, its metadata arrays parsed in one pass each: the package's parser makes every element a field
    of its own through several numpy calls (seconds for a 248k-token vocabulary, its token types and merges); here an
    array of numbers is split from one view and an array of strings walked by its lengths. The fields are the
    package's own (the same parts and data indices), so `ReaderField.contents` reads them unchanged."""
    import struct

    import gguf

    class ArrayReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            itype, n, offs = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            parts: list[np.ndarray] = [raw_itype, alen]
            types = [gguf.GGUFValueType.ARRAY] + [itype] * (n > 0)  # the package's: the first element's type
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, n)
                parts += list(values.reshape(n, 1))
                return offs + values.nbytes - orig_offs, parts, list(range(2, n + 2)), types
            if itype != gguf.GGUFValueType.STRING:  # arrays of arrays: the package's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            data, unpack = self.data.view(np.ndarray), struct.Struct("<Q").unpack_from  # a memmap slice runs Python
            for _ in range(n):
                length = unpack(data, offs)[0]
                parts += (data[offs : offs + 8].view(np.uint64), data[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(3, 2 * n + 3, 2)), types

    return ArrayReader


# Hugging Face names llama.cpp's converter renames before its table lookup (convert_hf_to_gguf.py: a router score
# bias is the `.bias` of `e_score_correction`, gpt-oss's attention sinks a `.weight`, a Gated DeltaNet's dt_bias the
# `.bias` of `dt_proj`)
_CONVERTER_RENAMES = (
    ("e_score_correction_bias", "e_score_correction.bias"),
    (".self_attn.sinks", ".self_attn.sinks.weight"),
    (".linear_attn.dt_bias", ".linear_attn.dt_proj.bias"),
    # Gemma 4's: the router's input scale a `.scale` of the router, the per-expert scale one of the down experts
    (".router.scale", ".router.proj.scale"),
    (".router.per_expert_scale", ".experts.down_proj.scale"),
    (".layer_scalar", ".layer_scalar.weight"),
)


class GgufNames:
    """Hugging Face tensor names <-> this architecture's GGUF names, by the gguf package's table."""

    def __init__(self, architecture: str, num_layers: int):
        import gguf

        arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}.get(architecture)
        if arch is None:
            raise ConfigError(f"GGUF architecture {architecture!r} is not one the gguf package knows")
        self.map = gguf.get_tensor_name_map(arch, num_layers)

    def gguf_name(self, hf_name: str) -> str | None:
        """`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight`; None where the table has none."""
        for old, new in _CONVERTER_RENAMES:
            if hf_name.endswith(old):
                hf_name = hf_name[: -len(old)] + new
        return self.map.get_name(hf_name, try_suffixes=(".weight", ".bias", ".scale"))

    def experts(self, layer: int) -> dict[str, str | None]:
        """{gate_proj|up_proj|down_proj: the GGUF name of layer `layer`'s routed experts [E, rows, cols]}."""
        return {part: self.gguf_name(f"model.layers.{layer}.mlp.experts.{part}.weight") for part in EXPERT_PARTS}

    def fused_gate_up(self, layer: int) -> str | None:
        """The GGUF name of layer `layer`'s gate and up experts as one tensor [E, 2I, cols], the gate's rows first,
        as llama.cpp's converter writes them when asked to fuse them (its `ffn_gate_up_exps`; None where this
        architecture's table has no such tensor)."""
        return self.gguf_name(f"model.layers.{layer}.mlp.experts.gate_up_proj.weight")

    def layer_experts(self, layer: int, tensors: dict) -> dict[str, str | None]:
        """`experts(layer)`, with gate and up both naming the fused tensor where `tensors` (the file's) holds it."""
        names = self.experts(layer)
        fused = self.fused_gate_up(layer)
        if names["gate_proj"] not in tensors and fused is not None and fused in tensors:
            names["gate_proj"] = names["up_proj"] = fused
        return names


# llama.cpp writes a model's multi-token-prediction (NextN) layer i as decoder block num_layers + i: the layer's
# tensors named as a decoder layer's, these under `nextn.` (its converter's renames; the gguf package's table lacks
# them for some architectures), MTP tensor -> name in block num_layers
GGUF_MTP_NEXTN = {
    "mtp.fc.weight": "nextn.eh_proj.weight",  # its input: [the token's embedding, the hidden state]
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")


def mtp_gguf_source(hf_name: str, num_layers: int) -> tuple[str, str]:
    """Where a GGUF file holds MTP tensor `hf_name` (mtp.…): ("gguf", its GGUF name) for the `nextn.` ones, or
    ("decoder", the decoder-layer name it is written as, `model.layers.{num_layers + i}.…`, for the family's read
    hook and the table); a ValueError for a name of neither kind."""
    if hf_name in GGUF_MTP_NEXTN:
        return "gguf", f"blk.{num_layers}.{GGUF_MTP_NEXTN[hf_name]}"
    m = _MTP_LAYER.match(hf_name)
    if m is None:
        raise ValueError(f"{hf_name!r} is not an MTP tensor a GGUF file holds")
    return "decoder", f"model.layers.{num_layers + int(m.group(1))}.{m.group(2)}"


def open_gguf(first: Path) -> GgufCheckpoint:
    """The GGUF set `first` opens, parsed once a process (while the file is unchanged): a header of a 150k-token
    vocabulary takes seconds, and boot asks for the config, both passes' tensors, the eos ids and the tokenizer."""
    st = Path(first).stat()
    return _opened(str(Path(first).resolve()), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=4)
def _opened(path: str, mtime_ns: int, size: int) -> GgufCheckpoint:
    return GgufCheckpoint(Path(path))


def load_gguf_config(first: Path) -> dict[str, Any]:
    """The config.json the GGUF's metadata stands for (the family's fields, plus the vocabulary size, tied
    embeddings, eos ids and the experts' quantization): a ConfigError naming what cannot be served, e.g.
    an architecture no family claims."""
    from ferry.plan.model_families import family_for_gguf

    ckpt = open_gguf(first)
    family = family_for_gguf(ckpt.architecture, str(first))
    config = family.gguf_config(ckpt.metadata, ckpt.tensors, str(first))
    config.setdefault("vocab_size", ckpt.array_length("tokenizer.ggml.tokens") or None)
    config.setdefault("tie_word_embeddings", "output.weight" not in ckpt.tensors)
    eos = ckpt.value("tokenizer.ggml.eos_token_id")
    if eos is not None:
        config.setdefault("eos_token_id", int(eos))
    # dense tensors are dequantized at load into the run dtype (--dtype); bf16 is what the published models run in
    config.setdefault("torch_dtype", "bfloat16")
    quantization = expert_quantization(ckpt, int(config["num_hidden_layers"]), str(first))
    if quantization is not None:
        config["quantization_config"] = quantization
    return config


def expert_quantization(ckpt: GgufCheckpoint, num_layers: int, where: str) -> dict[str, Any] | None:
    """The routed experts' quantization_config: their one ggml type; for several, `ggml_type: mixed` with
    `expert_types` ([w13 type, w2 type] per MoE layer: plan/expert_formats/gguf_mixed.py); None for float experts.
    A ConfigError naming the tensors where a layer's gate and up differ (w13 is one byte row) or float and block
    types mix."""
    names = ckpt.names()
    layers: list[dict[str, GgufTensor]] = []  # per MoE layer: {gate_proj|up_proj|down_proj: its tensor}
    for layer in range(num_layers):
        experts = names.layer_experts(layer, ckpt.tensors)
        present = {p: ckpt.tensors[n] for p, n in experts.items() if n is not None and n in ckpt.tensors}
        if present:
            layers.append(present)
    tensors = [t for parts in layers for t in parts.values()]
    if not tensors:
        return None
    floats = [t.name for t in tensors if t.ggml_type in FLOAT_TYPES]
    if len(floats) == len(tensors):
        return None  # loaded as values, whatever float type each is
    if floats:
        blocks = sorted({t.ggml_type for t in tensors} - set(FLOAT_TYPES))
        raise ConfigError(
            f"{where}: the routed experts mix float tensors ({_shown(floats)}) with {', '.join(blocks)} blocks; "
            "Ferry holds a file's experts either as values or as blocks: use a file whose ffn_*_exps tensors are all "
            "quantized (or all F32/F16/BF16)"
        )
    expert_types = []
    for parts in layers:
        gate, up = parts.get("gate_proj"), parts.get("up_proj")
        if gate is not None and up is not None and gate.ggml_type != up.ggml_type:
            raise ConfigError(
                f"{where}: {gate.name} is {gate.ggml_type} but {up.name} is {up.ggml_type}; a layer's gate and up "
                "experts are one byte row in Ferry's slots, so they must share a ggml type (requantize one of them, "
                f"e.g. llama-quantize --tensor-type ffn_up_exps={gate.ggml_type})"
            )
        first = next(iter(parts.values()))  # a layer short of a tensor is refused by the loader, naming it
        expert_types.append([(gate or up or first).ggml_type, parts.get("down_proj", first).ggml_type])
    types = {t for pair in expert_types for t in pair}
    if len(types) == 1:
        return {"quant_method": GGUF_METHOD, "ggml_type": types.pop()}
    return {"quant_method": GGUF_METHOD, "ggml_type": MIXED_TYPES, "expert_types": expert_types}


def _shown(names: list[str]) -> str:
    return f"{', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"


def transformers_gguf_fields(metadata: dict[str, Any], architecture: str, model_type: str) -> dict[str, Any]:
    """The config.json fields transformers' GGUF table (`transformers.integrations.ggml.GGUF_CONFIG_MAPPING`,
    with its defaults) reads from `{architecture}.*` keys for `model_type`: a family's gguf_config starts here
    and adds what that table leaves out."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    renames = GGUF_CONFIG_MAPPING.get(model_type, {})
    config: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}))
    for key, field in renames.items():
        value = metadata.get(f"{architecture}.{key}")
        if field is not None and value is not None:
            config[field] = value
    return config


def moe_layers_of(tensors: Iterable[str], num_layers: int, names: GgufNames) -> list[int]:
    """The layers whose routed experts the file holds."""
    present = set(tensors)
    return [layer for layer in range(num_layers) if names.layer_experts(layer, present)["gate_proj"] in present]
