"""Where a model's files are: a local Hugging Face directory, a GGUF file, or a hub id found in the local hub cache.

Ferry never downloads at boot (workers often run without network, and a 60 GB surprise download
is not a boot step): a hub id must already be in huggingface_hub's cache, e.g. from
`huggingface-cli download ORG/NAME`. The cache location follows huggingface_hub's own variables
(HF_HUB_CACHE, then HF_HOME/hub), read when we resolve, not when the library was imported."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ferry.plan.gguf_checkpoint import GGUF_SUFFIX, find_gguf, split_files
from ferry.shared.errors import ModelLoadError


def hub_cache_dir() -> Path | None:
    """The hub cache huggingface_hub would use now; None leaves it to the library's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    return None


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "~"))


def is_gguf(path: Path) -> bool:
    """Whether a resolved model path is a GGUF file (resolve_model_dir gives the file, not its directory)."""
    return path.is_file() and path.suffix == GGUF_SUFFIX


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The directory holding config.json (and weights, tokenizer) for `--model`, or the GGUF file it names
    (a `.gguf` file, the first of a split set, or a directory holding one and no config.json)."""
    path = Path(os.path.expanduser(model))
    gguf = find_gguf(path) if path.exists() else None
    if gguf is not None:
        unreadable = [f for f in split_files(gguf) if not os.access(f, os.R_OK)]
        if unreadable:
            raise ModelLoadError(_permission_denied(model, unreadable))
        return gguf
    if path.is_dir():
        _check_readable(path, model)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"--model {model}: the directory has no config.json (is it a Hugging Face model?)")
        return path
    if path.exists():
        raise ModelLoadError(
            f"--model {model}: not a directory or a .gguf file; give a model directory, a GGUF file or a hub id "
            "ORG/NAME"
        )
    if not _looks_like_hub_id(model):
        raise ModelLoadError(f"--model {model}: no such directory, and not a hub id of the form ORG/NAME")
    return _from_hub_cache(model, revision)


def check_model_exists(model: str, revision: str | None = None) -> None:
    """ModelLoadError naming --model unless `model` is an existing path or a hub id in the local cache: what a
    command checks before it starts anything (what the directory holds is the boot's to check)."""
    if Path(os.path.expanduser(model)).exists():
        return
    resolve_model_dir(model, revision)  # no such path: a hub id in the cache, or its error


def _from_hub_cache(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        where = cache if cache is not None else "the default hub cache (~/.cache/huggingface/hub)"
        raise ModelLoadError(
            f"--model {repo_id}: not a local directory and not in the Hugging Face cache at {where}. "
            f"Ferry does not download at boot: run `huggingface-cli download {repo_id}` first (HF_HUB_CACHE "
            "picks the cache), or pass --model a local directory"
        ) from exc
    _check_readable(snapshot, repo_id)
    if not (snapshot / "config.json").is_file():
        raise ModelLoadError(f"--model {repo_id}: the cached snapshot {snapshot} has no config.json")
    return snapshot


def _check_readable(directory: Path, model: str) -> None:
    """The model directory and every file in it must be readable by this process. Else a clear error
    naming them: safetensors reports a shard it may not open as "No such file or directory", and a
    container's user (uid 10001) often cannot read what its host user wrote."""
    if not os.access(directory, os.R_OK | os.X_OK):
        raise ModelLoadError(_permission_denied(model, [directory]))
    unreadable = [p for p in sorted(directory.iterdir()) if p.is_file() and not os.access(p, os.R_OK)]
    if unreadable:
        raise ModelLoadError(_permission_denied(model, unreadable))


def _permission_denied(model: str, paths: list[Path]) -> str:
    def described(path: Path) -> str:
        st = path.stat()
        return f"{path} (mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid})"

    shown = ", ".join(described(p) for p in paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return (
        f"--model {model}: permission denied: {shown}; this process runs as uid {os.getuid()}. Make the "
        "model readable by it, e.g. `chmod -R a+rX` on the model directory (in compose: on ./models or "
        "FERRY_MODEL_DIR, on the host)"
    )
