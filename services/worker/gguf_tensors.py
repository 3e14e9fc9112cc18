"""A GGUF checkpoint's tensors for the model's loader, under Hugging Face's names (plan/gguf_checkpoint.py reads
the file and maps the names; docs/ARCHITECTURE.md §4, "Weights").

Two passes, as for safetensors (services/worker/checkpoint.py):
* **resident** tensors (embeddings, attention, norms, routers, lm_head) are dequantized at load by the gguf
  package's numpy reference (`gguf.quants.dequantize`, any ggml type) into float32, which the loader copies
  into the run dtype: a file's dense bytes become run-dtype bytes on the GPU (Qwen3-30B-A3B's ~1.3 B dense
  values: ~2.6 GB in bf16 whatever the file's type), and the load pays one numpy decode of each;
* **routed experts** stay in their blocks: each expert's gate, up and down rows of the file's
  `ffn_{gate,up,down}_exps` [E, rows, row bytes] are yielded as a `GgufWeight` for the expert format
  (services/worker/expert_formats/gguf_*.py) to copy as they are; float experts (F32/F16/BF16) are values,
  and so are the experts' biases where the model has them (gpt-oss: `ffn_*_exps.bias` [E, rows]).

The MTP layer (--speculative-method mtp, `mtp_gguf_tensors`) is read as llama.cpp writes it, block num_layers
(plan/gguf_checkpoint.py's `mtp_gguf_source`), every tensor dequantized: its experts are GPU-resident values, as
from safetensors (plan/mtp_layer.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ferry.kernels.gguf_blocks import BLOCKS, dequantize_rows
from ferry.plan.costs import is_served
from ferry.plan.gguf_checkpoint import (
    FLOAT_TYPES,
    GgufCheckpoint,
    GgufNames,
    GgufTensor,
    mtp_gguf_source,
    open_gguf,
)
from ferry.plan.model_families import family_of
from ferry.plan.model_spec import ModelSpec
from ferry.plan.mtp_layer import mtp_resident_weight_shapes
from ferry.services.worker.quantized_weight import QuantizedWeight
from ferry.shared.errors import ModelLoadError


@dataclass(frozen=True)
class GgufWeight(QuantizedWeight):
    """One linear [O, IN] of a GGUF file in `ggml_type` blocks: `q` uint8 [O, row bytes], the file's bytes;
    `fmt` the expert format holding them (no separate scales: a block carries its own)."""

    ggml_type: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        block, size = BLOCKS[self.ggml_type]
        o, n = self.q.shape
        return o, n // size * block

    def dequantize(self, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        q = self.q.to(device) if device is not None else self.q
        return dequantize_rows(q, self.ggml_type, dtype)


def decoded(tensor: GgufTensor) -> np.ndarray:
    """A GGUF tensor as float32 values of its shape (the gguf package's reference decode), a copy: the mapping is
    read-only."""
    import gguf

    values = gguf.quants.dequantize(np.asarray(tensor.data), gguf.GGMLQuantizationType[tensor.ggml_type])
    return np.array(values, dtype=np.float32).reshape(tensor.shape)


def dequantized(tensor: GgufTensor) -> torch.Tensor:
    return torch.from_numpy(decoded(tensor))


def resident_gguf_tensors(path: Path, spec: ModelSpec, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) of every GPU-resident tensor; a ModelLoadError naming a missing one
    (a tied lm_head is none)."""
    from tqdm import tqdm

    ckpt = open_gguf(path)
    names = ckpt.names()
    family = family_of(spec)
    wanted = [n for n in family.resident_weight_shapes(spec) if is_served(n, spec)]

    def fetch(name: str) -> np.ndarray | None:
        tensor = ckpt.tensors.get(names.gguf_name(name) or "")
        return None if tensor is None else decoded(tensor)

    for hf_name in tqdm(wanted, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        values = fetch(hf_name) if family.gguf_read_tensor is None else family.gguf_read_tensor(spec, hf_name, fetch)
        if values is None:
            if hf_name == "lm_head.weight" and spec.tie_word_embeddings:
                continue
            gguf_name = names.gguf_name(hf_name)
            raise ModelLoadError(
                f"{path}: no tensor {gguf_name or '(none in the gguf table)'} for {hf_name} in the GGUF file"
            )
        yield hf_name, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def mtp_gguf_tensors(path: Path, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(`mtp.…` name, float32 tensor) of every MTP tensor, its routed experts per expert; the family's read hook
    undoes what the converter changed in the layer's tensors (norms shifted by one), as for the decoder's. A
    ModelLoadError naming a missing one."""
    ckpt = open_gguf(path)
    names = ckpt.names()  # over block_count, which counts the MTP layers
    family = family_of(spec)

    def fetch(name: str) -> np.ndarray | None:
        tensor = ckpt.tensors.get(names.gguf_name(name) or "")
        return None if tensor is None else decoded(tensor)

    for hf_name in mtp_resident_weight_shapes(spec):
        kind, source = mtp_gguf_source(hf_name, spec.num_layers)
        if kind == "gguf":  # a nextn. tensor: the hook undoes its converter's change (a norm shifted by one)
            tensor = ckpt.tensors.get(source)
            values = None if tensor is None else decoded(tensor)
            if values is not None and family.gguf_read_tensor is not None:
                values = family.gguf_read_tensor(spec, hf_name, lambda _: values)
        else:
            values = fetch(source) if family.gguf_read_tensor is None else family.gguf_read_tensor(spec, source, fetch)
        if values is None:
            raise ModelLoadError(f"{path}: no tensor for {hf_name} (MTP, {source}) in the GGUF file")
        yield hf_name, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    for layer in range(spec.mtp_draft_layers):
        block = spec.num_layers + layer
        stacked: dict[str, np.ndarray] = {}  # decoded once: a fused gate/up tensor serves two parts
        for part, gguf_name in names.layer_experts(block, ckpt.tensors).items():
            tensor = ckpt.tensors.get(gguf_name or "")
            if tensor is None:
                raise ModelLoadError(f"{path}: the MTP layer's routed experts need {gguf_name} in the GGUF file")
            if tensor.name not in stacked:
                stacked[tensor.name] = decoded(tensor)
            values = stacked[tensor.name]
            if gguf_name == names.fused_gate_up(block):
                i = spec.moe_intermediate_size
                values = values[:, :i] if part == "gate_proj" else values[:, i:]
            for e in range(values.shape[0]):
                yield f"mtp.layers.{layer}.mlp.experts.{e}.{part}.weight", torch.from_numpy(values[e].copy())


def routed_expert_gguf_tensors(
    path: Path, spec: ModelSpec, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor | GgufWeight]]:
    """(`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, its rows) of every routed expert: a GgufWeight
    of the file's blocks, or float32 values for float experts."""
    from tqdm import tqdm

    ckpt = open_gguf(path)
    names = ckpt.names()
    fmt = spec.quantization.expert_format if spec.quantization is not None else None
    for layer in tqdm(spec.moe_layer_indices, desc="loading experts", unit="layer", disable=not progress, leave=False):
        for part, gguf_name in names.layer_experts(layer, ckpt.tensors).items():
            tensor = ckpt.tensors.get(gguf_name or "")
            if tensor is None or len(tensor.shape) != 3 or tensor.shape[0] != spec.num_experts:
                raise ModelLoadError(
                    f"{path}: layer {layer}'s routed experts need {gguf_name} [{spec.num_experts}, rows, cols] in the "
                    f"GGUF file, found {'none' if tensor is None else list(tensor.shape)}"
                )
            rows = slice(None)
            if gguf_name == names.fused_gate_up(layer):  # [E, 2I, cols]: the gate's rows, then the up's
                i = spec.moe_intermediate_size
                rows = slice(0, i) if part == "gate_proj" else slice(i, 2 * i)
            yield from _experts_of(tensor, layer, part, fmt, rows)
            if spec.expert_bias:
                yield from _expert_biases(ckpt, names, path, layer, part)


def _expert_biases(
    ckpt: GgufCheckpoint, names: GgufNames, path: Path, layer: int, part: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """`model.layers.L.mlp.experts.E.{part}.bias` of every expert, from the file's `ffn_{part}_exps.bias` [E, rows]."""
    gguf_name = names.gguf_name(f"model.layers.{layer}.mlp.experts.{part}.bias")
    if gguf_name not in ckpt.tensors:
        raise ModelLoadError(
            f"{path}: layer {layer}'s routed experts have biases, but the GGUF file has no {gguf_name}"
        )
    values = dequantized(ckpt.tensors[gguf_name])
    for e in range(values.shape[0]):
        yield f"model.layers.{layer}.mlp.experts.{e}.{part}.bias", values[e]


def _experts_of(tensor: GgufTensor, layer: int, part: str, fmt: str | None, rows: slice):
    """Each expert's `rows` of `part` in `tensor` [E, rows, cols] (all of them, or its share of a fused tensor)."""
    prefix = f"model.layers.{layer}.mlp.experts"
    if tensor.ggml_type in FLOAT_TYPES:
        values = dequantized(tensor)
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.{part}.weight", values[e, rows]
        return
    blocks = np.asarray(tensor.data)
    for e in range(tensor.shape[0]):
        q = torch.from_numpy(np.array(blocks[e, rows], dtype=np.uint8))  # one expert's rows, copied off the mapping
        yield f"{prefix}.{e}.{part}.weight", GgufWeight(fmt, q, None, None, tensor.name, ggml_type=tensor.ggml_type)
