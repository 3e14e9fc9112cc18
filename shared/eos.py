"""End-of-sequence token ids as transformers' `generate` uses them: the model config's and
generation_config.json's (either may be one id or a list). No torch."""

from __future__ import annotations

import json
from pathlib import Path


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list) else {int(value)}


def eos_token_ids(model_dir: str | Path) -> set[int]:
    model_dir = Path(model_dir)
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        raw = json.loads(path.read_text())
        ids |= _ids(raw.get("eos_token_id"))
        ids |= _ids((raw.get("text_config") or {}).get("eos_token_id"))
    return ids
