"""The model dtypes the planner prices and the worker allocates, their bytes, and `--dtype`'s spellings. A leaf
module (it imports nothing of the plan): the expert formats' prices and the model config both read it."""

from __future__ import annotations

from ferry.shared.errors import ConfigError

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def normalize_dtype(name: str) -> str:
    name = DTYPE_ALIASES.get(str(name).lower().removeprefix("torch."), str(name).lower().removeprefix("torch."))
    if name not in DTYPE_BYTES:
        raise ConfigError(f"unsupported dtype {name!r}: use one of {', '.join(DTYPE_BYTES)} (--dtype)")
    return name
