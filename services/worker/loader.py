"""Model loading: find the model's files, read its config, and stream its weights in two passes.

`open_model(--model, --load-format)` resolves the source once; `resident_weights` and
`routed_expert_weights` then yield (checkpoint name, tensor) pairs for the model's
`load_weights`, either read from safetensors or a GGUF file (gguf_tensors.py), or fabricated
(`--load-format dummy`). The boot sequence calls the resident pass before planning and the expert
pass after the expert pool is allocated (docs/ARCHITECTURE.md §2 rule 3)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ferry.plan.model_config import ModelSpec, load_model_config
from ferry.services.worker.checkpoint import (
    checkpoint_files,
    iter_checkpoint_tensors,
    resident_tensor,
    routed_expert_tensor,
)
from ferry.services.worker.dummy_weights import iter_dummy_tensors
from ferry.services.worker.flags import LOAD_FORMATS
from ferry.services.worker.gguf_tensors import resident_gguf_tensors, routed_expert_gguf_tensors
from ferry.services.worker.model_source import is_gguf, resolve_model_dir
from ferry.shared.errors import ConfigError, ModelLoadError

GGUF_LOAD = "gguf"  # ModelFiles.load_format of a GGUF file (--load-format auto)


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model: its directory, its architecture, and how its weights will be produced."""

    model_dir: Path  # the model's directory, or its GGUF file (the first of a split set)
    spec: ModelSpec
    load_format: str  # safetensors | gguf | dummy (auto resolved)


def open_model(model: str, load_format: str = "auto", revision: str | None = None) -> ModelFiles:
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    model_dir = resolve_model_dir(model, revision)
    spec = load_model_config(model_dir)
    if load_format == "dummy":
        return ModelFiles(model_dir, spec, "dummy")
    if is_gguf(model_dir):
        if load_format == "safetensors":
            raise ConfigError(f"--model {model} is a GGUF file: leave --load-format auto")
        return ModelFiles(model_dir, spec, GGUF_LOAD)
    try:
        checkpoint_files(model_dir)
    except ModelLoadError as exc:
        raise ModelLoadError(f"--model {model}: {exc}") from exc
    return ModelFiles(model_dir, spec, "safetensors")


def resident_weights(
    files: ModelFiles, dtype: torch.dtype, device: torch.device | str, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Everything that stays on the GPU: embeddings, attention, norms, routers, shared experts, lm_head."""
    if files.load_format == "dummy":
        return iter_dummy_tensors(files.spec, dtype, device, routed_experts=False, progress=progress)
    if files.load_format == GGUF_LOAD:
        return resident_gguf_tensors(files.model_dir, files.spec, progress)
    select = partial(resident_tensor, spec=files.spec)
    return iter_checkpoint_tensors(files.model_dir, select, "loading weights", progress)


def routed_expert_weights(
    files: ModelFiles, dtype: torch.dtype, device: torch.device | str, progress: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every routed expert's tensors, for the expert store (slots, or host banks when offloading)."""
    if files.load_format == "dummy":
        return iter_dummy_tensors(files.spec, dtype, device, routed_experts=True, progress=progress)
    if files.load_format == GGUF_LOAD:
        return routed_expert_gguf_tensors(files.model_dir, files.spec, progress)
    select = partial(routed_expert_tensor, spec=files.spec)
    return iter_checkpoint_tensors(files.model_dir, select, "loading experts", progress)
