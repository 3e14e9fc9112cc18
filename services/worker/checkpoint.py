"""Reading a safetensors checkpoint: its files, and its tensors one at a time with a progress bar
(on a terminal) or `loading_progress` log events (in JSON logs).

Two passes over the same files (docs/ARCHITECTURE.md §2 rule 3): the GPU-resident tensors first, before the
planner runs, and the routed experts after the expert pool exists. `safe_open` reads only the
tensors a pass selects, so neither pass touches the other's bytes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog
import torch

from ferry.plan.costs import is_routed_expert, is_served
from ferry.plan.model_spec import ModelSpec
from ferry.services.worker.quantized_weight import group_quantized_tensors
from ferry.shared.errors import ModelLoadError
from ferry.shared.units import format_bytes

INDEX_FILE = "model.safetensors.index.json"
# Without a terminal there is no bar: a service's stderr is JSON lines (boot.py's _progress_bars). A pass
# takes minutes at full size (Qwen3-30B-A3B's experts: about two), so every this many seconds it logs
# a `loading_progress` event instead, for a log reader to see the load advance rather than a silence.
PROGRESS_EVERY_S = 5.0

log = structlog.get_logger("worker")


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
        raise ModelLoadError(f"no *.safetensors files in {model_dir}; use --load-format dummy to run without weights")
    return files


def resident_tensor(name: str, spec: ModelSpec | None = None) -> bool:
    return is_served(name, spec) and not is_routed_expert(name)


def routed_expert_tensor(name: str, spec: ModelSpec | None = None) -> bool:
    return is_served(name, spec) and is_routed_expert(name)


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


def _read_tensors(
    names_by_file: list[tuple[Path, list[str]]], desc: str, progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    total = sum(len(names) for _, names in names_by_file)
    events = None if progress else _ProgressEvents(desc, total)
    with tqdm(total=total, desc=desc, unit="tensor", disable=not progress, leave=False) as bar:
        for path, names in names_by_file:
            if not names:
                continue
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    nbytes = tensor.nbytes
                    yield name, tensor
                    bar.update(1)
                    if events is not None:
                        events.update(nbytes)
    if events is not None:
        events.close()


class _ProgressEvents:
    """The progress bar as log events: tensors done of the pass's total, bytes read, seconds so far.
    The time counted is the pass's, the consumer's copies to the device included (they are the load)."""

    def __init__(self, desc: str, total: int):
        self.desc, self.total, self.every = desc, total, PROGRESS_EVERY_S
        self.started = self.last = time.monotonic()
        self.done = self.bytes = 0
        self.logged_done = 0

    def update(self, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        now = time.monotonic()
        if now - self.last >= self.every:
            self._log(now)

    def close(self) -> None:
        """A pass that logged progress also logs its end; a short one stays silent (boot logs its duration)."""
        if self.logged_done and self.logged_done != self.done:
            self._log(time.monotonic())

    def _log(self, now: float) -> None:
        self.last, self.logged_done = now, self.done
        log.info(
            "loading_progress",
            what=self.desc,
            tensors=self.done,
            total=self.total,
            bytes=self.bytes,
            size=format_bytes(self.bytes),
            seconds=round(now - self.started, 1),
        )
