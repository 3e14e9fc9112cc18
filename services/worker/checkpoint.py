"""Reading a safetensors checkpoint: its files, and its tensors one at a time with a progress bar.

Two passes over the same files (docs/ARCHITECTURE.md §2 rule 3): the GPU-resident tensors first, before the
planner runs, and the routed experts after the expert pool exists. `safe_open` reads only the
tensors a pass selects, so neither pass touches the other's bytes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ferry.shared.errors import ModelLoadError
from ferry.plan.costs import is_routed_expert, is_served
from ferry.services.worker.quantized_weight import group_quantized_tensors

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors shards: from the index when there is one (only the shards it names), else every file."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index ({exc})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are not there: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {model_dir}; use --load-format dummy to run without weights"
        )
    return files


def resident_tensor(name: str) -> bool:
    return is_served(name) and not is_routed_expert(name)


def routed_expert_tensor(name: str) -> bool:
    return is_served(name) and is_routed_expert(name)


def iter_checkpoint_tensors(
    model_dir: Path, select: Callable[[str], bool], desc: str, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, CPU tensor as stored) for every selected tensor, shard by shard; each
    quantized linear as one (`module.weight`, QuantizedWeight) once all its parts are read
    (quantized_weight.py).

    The model's load_weights copies each into its parameter (converting dtype and moving it to
    the device), so at most one tensor (or one quantized module) is held on the host at a time."""
    from safetensors import safe_open

    files = checkpoint_files(model_dir)
    names_by_file = []
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            names_by_file.append((path, [n for n in f.keys() if select(n)]))
    names = [n for _, ns in names_by_file for n in ns]
    return group_quantized_tensors(_read_tensors(names_by_file, desc, progress), names)


def _read_tensors(names_by_file: list[tuple[Path, list[str]]], desc: str, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    total = sum(len(names) for _, names in names_by_file)
    with tqdm(total=total, desc=desc, unit="tensor", disable=not progress, leave=False) as bar:
        for path, names in names_by_file:
            if not names:
                continue
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in names:
                    yield name, f.get_tensor(name)
                    bar.update(1)
