"""Model definitions served by Ferry: plain nn.Module trees over the paged pools.

`build_model(spec, dtype, device, experts)` gives a `CausalLM` composed by the spec's family (registry.py:
one module per family here, built from the shared layers in services/worker/layers/); `CausalLM.load_weights`
takes checkpoint tensors; `CausalLM.forward(batch, pools)` gives float32 logits of the rows that sample."""

from __future__ import annotations

import torch

from ferry.plan.model_config import ModelSpec
from ferry.services.worker.models.decoder import CausalLM
from ferry.services.worker.models.registry import family_named
from ferry.services.worker.models.weights import WeightLoadError
from ferry.services.worker.offload.stores.expert_store import ExpertStore
from ferry.shared.errors import ConfigError

__all__ = ["CausalLM", "WeightLoadError", "build_model"]


def build_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, experts: ExpertStore) -> CausalLM:
    """An unloaded model (parameters allocated on `device`, routed experts left to `experts`)."""
    family = family_named(spec.arch)
    family.check(spec)
    if experts.num_experts != spec.num_experts:
        raise ConfigError(
            f"the expert store holds {experts.num_experts} experts per layer but num_experts is {spec.num_experts}"
        )
    return CausalLM(spec, dtype, torch.device(device), experts, family).eval()
