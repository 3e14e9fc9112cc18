"""End-of-sequence token ids: the one place that says which tokens end a request (unless it sets
ignore_eos). The api and `ferry generate` both ask here. No torch."""

from __future__ import annotations

import json
from pathlib import Path

from ferry.plan.gguf_checkpoint import find_gguf, open_gguf

# a GGUF's end-of-sequence ids: the eos, and llama.cpp's end-of-turn and end-of-message tokens
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def eos_token_ids(model_dir: str | Path | None, tokenizer=None) -> tuple[int, ...]:
    """The tokenizer's eos_token_id and the model's (config.json, its text_config, and
    generation_config.json; each may be one id or a list; a GGUF file's metadata), sorted. transformers'
    `generate` stops on all of them: chat models often end a turn with a token that is not the tokenizer's eos_token.
    `model_dir` None (a tokenizer from the hub, no local directory): the tokenizer's only."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gguf = find_gguf(model_dir) if model_dir is not None and Path(model_dir).exists() else None
    if gguf is not None:  # a GGUF file (or a directory holding one): its metadata's ids
        return tuple(sorted(ids | _gguf_eos(gguf)))
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name if model_dir is not None else None
        if path is None or not path.is_file():
            continue
        raw = json.loads(path.read_text())
        ids |= _ids(raw.get("eos_token_id"))
        ids |= _ids((raw.get("text_config") or {}).get("eos_token_id"))
    return tuple(sorted(ids))


def _gguf_eos(path: Path) -> set[int]:
    ckpt = open_gguf(path)
    return {int(v) for v in (ckpt.value(key) for key in _GGUF_EOS_KEYS) if v is not None}
