"""The model families' torch halves, by name (`ModelSpec.arch`); `build_model` looks a spec's up here.

Every module of this package is imported once, on the first lookup, so a family's module registers itself
by existing. A new family (its torch-free half registered in plan/model_families/, which says what that
half gives) adds one module here that:
  * subclasses `DecoderFamily` (models/decoder.py), overriding `mixer` (which token mixer each layer uses,
    under its checkpoint name) and any default that differs: norms, MLP or MoE block, rotary embedding,
    `check` (config.json fields it cannot compute), `checkpoint_tensors` / `checkpoint_names` (a checkpoint
    layout other than the module tree's names);
  * builds those from the shared layers (services/worker/layers/), adding a layer there when it is new;
  * calls `register(TheFamily("name"))` with the plan family's name;
and its tests: the tiny model's parity with transformers (tests/unit/test_model_parity.py's list)."""

from __future__ import annotations

import importlib
import pkgutil

from ferry.services.worker.models.decoder import DecoderFamily
from ferry.shared.errors import ConfigError

_FAMILIES: dict[str, DecoderFamily] = {}
_discovered = False
_PACKAGE = __name__.rpartition(".")[0]


def register(family: DecoderFamily) -> DecoderFamily:
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, DecoderFamily]:
    """{name: family} of every registered family."""
    global _discovered
    if not _discovered:
        _discovered = True
        package = importlib.import_module(_PACKAGE)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{_PACKAGE}.{module.name}")
    return _FAMILIES


def family_named(name: str) -> DecoderFamily:
    family = families().get(name)
    if family is None:
        raise ConfigError(
            f"model family {name!r} has no implementation in the worker; it has {', '.join(sorted(families()))}"
        )
    return family
