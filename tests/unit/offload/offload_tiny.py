"""A tiny qwen3_moe spec and randomly weighted stores for the offload tests."""

from __future__ import annotations

import torch

from ferry.plan import pool_layout as L
from ferry.plan.model_config import ModelSpec, parse_model_config
from ferry.services.worker.pools import ExpertSlotPool, allocate_pool


def tiny_spec(
    layers: int = 3, experts: int = 6, top_k: int = 3, hidden: int = 16, inter: int = 8, quantization=None
) -> ModelSpec:
    """`quantization`: the config's quantization_config, where the experts are held in a quantized format."""
    return parse_model_config(
        {
            "model_type": "qwen3_moe",
            "vocab_size": 64,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": inter,
            "intermediate_size": 32,
            "max_position_embeddings": 256,
            "torch_dtype": "float32",
            **({"quantization_config": quantization} if quantization is not None else {}),
        }
    )


def slot_pool(
    spec: ModelSpec, slots: int, dtype: str = "float32", max_step_tokens: int = 256, device: str = "cpu", fmt=None
) -> ExpertSlotPool:
    """`fmt`: the slots' expert format (services/worker/expert_formats), where its rows are not plain ones."""
    return ExpertSlotPool(allocate_pool(L.expert_slot_layout(spec, dtype, slots, max_step_tokens), device), fmt)


def random_experts(spec: ModelSpec, seed: int) -> dict[tuple[int, int], tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    h, i = spec.hidden_size, spec.moe_intermediate_size
    return {
        (layer, e): (
            torch.randn(i, h, generator=g) * h**-0.5,
            torch.randn(i, h, generator=g) * h**-0.5,
            torch.randn(h, i, generator=g) * i**-0.5,
        )
        for layer in range(len(spec.moe_layer_indices))
        for e in range(spec.num_experts)
    }


def random_routing(spec: ModelSpec, tokens: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(tokens, spec.hidden_size, generator=g)
    logits = torch.randn(tokens, spec.num_experts, generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(spec.num_experts_per_tok, dim=-1)
    return x, ids, weights / weights.sum(-1, keepdim=True)


def assert_rows_agree(got: torch.Tensor, want: torch.Tensor, pairs: int, tol: float, what: str) -> None:
    """Two stores' rows of one layer: bit for bit where the step took the pair kernel (`pairs` token-expert pairs;
    both compute them alike), else within `tol` (the grouped GEMM's order of sums may differ)."""
    from ferry.kernels.expert_pair_gemv import use_pair_kernel

    if use_pair_kernel(pairs):
        assert torch.equal(got, want), f"{what}: the stores differ"
    else:
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
