"""The MTP head's K/V write (services/worker/models/mtp_head.py `write_kv`, what a decode graph runs after its
sampling), built the same way in the test process (its torch path) and in test_mtp_head.py's interpreted child
(the Triton path: the fc and key/value projections through the dense GEMV, the fused key norm + rotary + write)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ferry.kernels.dispatch import use_triton
from ferry.plan.model_config import load_model_config
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.services.worker.models.mtp_head import MtpCache, MtpHead, random_mtp_tensors


class _OneLayerPool:
    """The KV pool's reading side as the head uses it: one layer's K/V caches, no fp8 scales."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v

    def layer(self, layer: int):
        return self.k, self.v

    def layer_scales(self, layer: int):
        return None, None


def written_kv(
    model_dir: str, dtype: torch.dtype, hidden, embeds, positions, slots, pages: int, page_size: int, triton: bool
):
    """(K cache, V cache), NaN but at `slots`, after the head (random tensors, seed 3) writes the rows' K/V;
    `triton`: the path this process's dispatch must take."""
    if use_triton(hidden) != triton:
        raise AssertionError(f"the {'Triton' if triton else 'torch'} path was asked, the dispatch takes the other")
    spec = load_model_config(model_dir)
    rotary = RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta)
    head = MtpHead(spec, rotary, dtype)
    head.load_weights(random_mtp_tensors(spec, seed=3).items())
    shape = (pages, page_size, spec.num_kv_heads, spec.head_dim)
    k, v = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    cache = MtpCache(_OneLayerPool(k, v), 0, SimpleNamespace(slot_mapping=slots))
    with torch.inference_mode():
        head.write_kv(hidden.to(dtype), embeds.to(dtype), positions, cache)
    return k, v
