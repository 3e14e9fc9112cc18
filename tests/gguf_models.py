"""Tiny GGUF models (services/gguf_writer.py: a tiny qwen3_moe rewritten as llama.cpp lays a GGUF out) and
the reference they are held to: the same file decoded by the gguf package alone (its reader and its numpy
`gguf.quants.dequantize`), saved as a float32 Hugging Face checkpoint for transformers to load. Nothing of
Ferry's reading or decoding of GGUF is used here, only the gguf package's name table to put each tensor
under its Hugging Face name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np


def tiny_gguf(root: Path, expert_type: str, hf_dir: Path | None = None, seed: int = 0) -> tuple[Path, Path]:
    """(the GGUF file, the Hugging Face checkpoint it was written from) under `root`."""
    from ferry.services.gguf_writer import GGUF_SIZES, write_gguf
    from ferry.services.make_tiny_model import make_tiny_model

    if hf_dir is None:
        hf_dir = make_tiny_model(root / "hf", "qwen3_moe", seed=seed, **GGUF_SIZES)
    return write_gguf(hf_dir, root / f"tiny-{expert_type}.gguf", expert_type, seed=seed), hf_dir


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
    for name in load_file(hf_dir / "model.safetensors"):
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.part.weight <- blk.L.ffn_part_exps [E, ...]
            head, expert, part, _ = name.rsplit(".", 3)
            stacked = decoded(names.get_name(f"{head}.{part}.weight", try_suffixes=(".weight",)))
            state[name] = np.ascontiguousarray(stacked[int(expert)])
        else:
            state[name] = decoded(names.get_name(name, try_suffixes=(".weight", ".bias")))
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    for f in hf_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out
