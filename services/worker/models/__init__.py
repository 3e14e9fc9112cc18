"""Model definitions served by Ferry: plain nn.Module trees over the paged pools.

`build_model(spec, dtype, device, experts)` gives a `CausalLM` for any supported architecture
(qwen3_moe, qwen3_next, qwen3_5_moe text); `CausalLM.load_weights` takes checkpoint tensors;
`CausalLM.forward(batch, pools)` gives float32 logits of the rows that sample."""

from __future__ import annotations

import torch

from ferry.plan.model_config import ARCHITECTURES, ModelSpec
from ferry.services.worker.models.decoder import CausalLM
from ferry.services.worker.models.weights import WeightLoadError
from ferry.services.worker.offload.stores.expert_store import ExpertStore
from ferry.shared.errors import ConfigError

__all__ = ["CausalLM", "WeightLoadError", "build_model"]


def build_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, experts: ExpertStore) -> CausalLM:
    """An unloaded model (parameters allocated on `device`, routed experts left to `experts`)."""
    if spec.arch not in set(ARCHITECTURES.values()):
        raise ConfigError(f"model architecture {spec.arch!r} has no implementation")
    if spec.text_config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act {spec.text_config['hidden_act']!r} is not supported (silu only)")
    if spec.text_config.get("use_sliding_window"):
        # transformers then limits every attention layer to `sliding_window` keys; we attend to all
        raise ConfigError("config.json: use_sliding_window=true is not supported (full causal attention only)")
    if experts.num_experts != spec.num_experts:
        raise ConfigError(
            f"the expert store holds {experts.num_experts} experts per layer but num_experts is {spec.num_experts}"
        )
    return CausalLM(spec, dtype, torch.device(device), experts).eval()
