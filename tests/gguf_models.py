"""Tiny GGUF models (services/gguf_writer.py: a tiny qwen3_moe, glm4_moe, gpt_oss or gemma4 rewritten as llama.cpp
lays a GGUF out) and
the reference they are held to: the same file decoded by the gguf package alone (its reader and its numpy
`gguf.quants.dequantize`), saved as a float32 Hugging Face checkpoint for transformers to load. Nothing of
Ferry's reading or decoding of GGUF is used here, only the gguf package's name table to put each tensor
under its Hugging Face name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# llama.cpp's converter renames these before its table lookup (convert_hf_to_gguf.py): by the name's last part, and
# Gemma 4's by their ends (its router's input scale as the router's `.scale`, the per-expert scale the down experts')
CONVERTER_RENAMES = {"e_score_correction_bias": "e_score_correction.bias", "sinks": "sinks.weight"}
CONVERTER_SUFFIX_RENAMES = (
    (".router.scale", ".router.proj.scale"),
    (".router.per_expert_scale", ".experts.down_proj.scale"),
    (".layer_scalar", ".layer_scalar.weight"),
)
# gpt-oss's fused experts: each layer's gate and up (interleaved) and down, with their biases
FUSED = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")
# Gemma 4's, not under `mlp.`: gate and up [E, 2I, H] (the gate's rows first) and down [E, H, I], as the file's
GEMMA4_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def tiny_gguf(
    root: Path, expert_type: str, hf_dir: Path | None = None, seed: int = 0, arch: str = "qwen3_moe"
) -> tuple[Path, Path]:
    """(the GGUF file, the Hugging Face checkpoint of family `arch` it was written from) under `root`."""
    from ferry.services.gguf_writer import GGUF_SIZES, write_gguf
    from ferry.services.make_tiny_model import make_tiny_model

    if hf_dir is None:
        hf_dir = make_tiny_model(root / f"hf-{arch}", arch, seed=seed, **GGUF_SIZES)
    return write_gguf(hf_dir, root / f"tiny-{arch}-{expert_type}.gguf", expert_type, seed=seed), hf_dir


def dequantized_reference(gguf_file: Path, hf_dir: Path, out: Path) -> Path:
    """The GGUF's tensors decoded by the gguf package, under the Hugging Face names of `hf_dir`'s checkpoint
    (its config and tokenizer copied), float32: what transformers is run on."""
    import gguf
    from safetensors.numpy import load_file, save_file

    reader = gguf.GGUFReader(str(gguf_file))
    arch = {n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}[reader.fields["general.architecture"].contents()]
    config = json.loads((hf_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tensors = {t.name: t for t in reader.tensors}

    def decoded(gguf_name: str) -> np.ndarray:
        t = tensors[gguf_name]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        return np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)

    out.mkdir(parents=True, exist_ok=True)
    state = {}

    def hf_named(name: str) -> np.ndarray:
        for old, new in CONVERTER_SUFFIX_RENAMES:
            if name.endswith(old):
                name = name[: -len(old)] + new
        head, _, last = name.rpartition(".")
        suffixes = (".weight", ".bias", ".scale")
        return decoded(names.get_name(f"{head}.{CONVERTER_RENAMES.get(last, last)}", try_suffixes=suffixes))

    for name in load_file(hf_dir / "model.safetensors"):
        if config["model_type"].startswith("gemma4") and name.endswith(GEMMA4_EXPERTS):
            state[name] = decoded(names.get_name(f"{name}.weight", try_suffixes=(".weight",)))
        elif name.endswith(FUSED):  # gpt-oss: blk.L.ffn_{gate,up}_exps [E, I, H] -> gate_up_proj [E, H, 2I] interleaved
            head, fused = name.rsplit(".", 1)
            suffix = ".bias" if fused.endswith("_bias") else ".weight"
            if fused.startswith("down_proj"):
                down = hf_named(f"{head}.down_proj{suffix}")
                state[name] = np.ascontiguousarray(down if suffix == ".bias" else down.transpose(0, 2, 1))
                continue
            gate, up = hf_named(f"{head}.gate_proj{suffix}"), hf_named(f"{head}.up_proj{suffix}")
            both = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, *gate.shape[2:])  # rows interleaved
            state[name] = np.ascontiguousarray(both if suffix == ".bias" else both.transpose(0, 2, 1))
        elif ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.part.weight <- blk.L.ffn_part_exps [E, ...]
            head, expert, part, _ = name.rsplit(".", 3)
            stacked = decoded(names.get_name(f"{head}.{part}.weight", try_suffixes=(".weight",)))
            state[name] = np.ascontiguousarray(stacked[int(expert)])
        else:
            state[name] = hf_named(name)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    for f in hf_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def rounded_reference(gguf_file: Path, hf_dir: Path, out: Path) -> Path:
    """`hf_dir`'s checkpoint with only what writing it as `gguf_file` lost: each routed expert as the gguf package
    decodes the file's blocks, each dense tensor the file holds in F16 rounded to F16 (rounding is elementwise, so
    it commutes with whatever llama.cpp's converter re-signs, shifts or reorders, and this reference needs no
    inverse of those: the model the file must read back as). The models whose converter changes values (the
    Qwen3.5 hybrids) are held to this; the others to `dequantized_reference`."""
    import gguf
    from safetensors.numpy import load_file, save_file

    from ferry.plan.gguf_checkpoint import GgufNames

    reader = gguf.GGUFReader(str(gguf_file))
    architecture = reader.fields["general.architecture"].contents()
    config = json.loads((hf_dir / "config.json").read_text())
    names = GgufNames(architecture, config["num_hidden_layers"])
    tensors = {t.name: t for t in reader.tensors}
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, value in load_file(hf_dir / "model.safetensors").items():
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.part.weight <- blk.L.ffn_part_exps [E, ...]
            head, expert, part, _ = name.rsplit(".", 3)
            t = tensors[names.gguf_name(f"{head}.{part}.weight")]
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            stacked = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            state[name] = np.ascontiguousarray(stacked[int(expert)])
            continue
        value = value.astype(np.float32)
        written = tensors.get(names.gguf_name(name))
        # a tensor the converter splits (qwen3next's in_proj_qkvz into attn_qkv and attn_gate): matrices, F16
        f16 = value.ndim == 2 if written is None else written.tensor_type == gguf.GGMLQuantizationType.F16
        if f16:
            value = value.astype(np.float16).astype(np.float32)
        state[name] = value
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    for f in hf_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out
