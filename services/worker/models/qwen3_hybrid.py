"""The Qwen3 hybrids' composition, qwen3_next and qwen3_5_moe: one module, as they compute the same thing.

Each layer mixes tokens with the Gated DeltaNet (`linear_attn`) or gated full attention (`self_attn`) as the
spec's `layer_types` say; every RMSNorm but the Gated DeltaNet's output norm is zero-centred (the spec's
`zero_centered_norms`); the MoE block has a shared expert. They differ only in where the config and the
tensors sit (plan/model_families/qwen3_hybrid.py reads both configs): qwen3_next stores the Gated DeltaNet's
input projection as two per-key-head interleaved tensors, `in_proj_qkvz` and `in_proj_ba`, which the
weight-name map permutes into the four row blocks (`in_proj_qkv`, `_z`, `_b`, `_a`) that qwen3_5_moe stores
and the layer keeps; its dummy weights are named that way too."""

from __future__ import annotations

import re

import torch
from torch import nn

from ferry.plan.model_config import LINEAR_ATTENTION, ModelSpec
from ferry.services.worker.layers.attention import PagedAttention
from ferry.services.worker.layers.gated_deltanet import GatedDeltaNet
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.services.worker.models.decoder import DecoderFamily, Tensors
from ferry.services.worker.models.registry import register
from ferry.services.worker.models.weights import WeightLoadError

_INTERLEAVED = re.compile(r"(layers\.\d+\.linear_attn)\.in_proj_(qkvz|ba)\.weight")
_SPLIT = re.compile(r"(model\.layers\.\d+\.linear_attn)\.in_proj_(qkv|z|b|a)\.weight")


class Qwen3Hybrid(DecoderFamily):
    def mixer(
        self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, dtype: torch.dtype, device
    ) -> tuple[str, nn.Module]:
        if spec.layer_types[layer] == LINEAR_ATTENTION:
            return "linear_attn", GatedDeltaNet(spec, layer, dtype, device)
        return "self_attn", PagedAttention(spec, layer, rotary, dtype, device)

    def checkpoint_tensors(self, spec: ModelSpec, name: str, tensor: torch.Tensor, source: str) -> Tensors:
        """Either hybrid's checkpoint loads into either: the interleaved in_proj_qkvz / in_proj_ba are
        permuted into the four row blocks, which load as they are."""
        m = _INTERLEAVED.fullmatch(name)
        if m is None:
            return ((name, tensor),)
        pieces = _split_qkvz(spec, tensor, source) if m[2] == "qkvz" else _split_ba(spec, tensor, source)
        return tuple((f"{m[1]}.in_proj_{part}.weight", piece) for part, piece in pieces.items())


class Qwen3Next(Qwen3Hybrid):
    """qwen3_next: its checkpoints store the Gated DeltaNet's in_proj interleaved by key head."""

    def checkpoint_names(self, spec: ModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        h = spec.hidden_size
        for name, shape in shapes.items():
            m = _SPLIT.fullmatch(name)
            if m is None:
                out[name] = shape
            elif m[2] == "qkv":  # z joins it; b and a become in_proj_ba
                out[f"{m[1]}.in_proj_qkvz.weight"] = (2 * spec.linear_key_dim + 2 * spec.linear_value_dim, h)
            elif m[2] == "b":
                out[f"{m[1]}.in_proj_ba.weight"] = (2 * spec.linear_num_value_heads, h)
        return out


def _split_qkvz(spec: ModelSpec, w: torch.Tensor, source: str) -> dict[str, torch.Tensor]:
    """Rows grouped by key head: [q_h | k_h | v of its value heads | z of them] per head h."""
    s = spec
    ratio = s.linear_num_value_heads // s.linear_num_key_heads
    per_head = 2 * s.linear_key_head_dim + 2 * ratio * s.linear_value_head_dim
    if w.shape[0] != s.linear_num_key_heads * per_head:
        raise WeightLoadError(
            f"checkpoint tensor {source!r} has {w.shape[0]} rows, expected {s.linear_num_key_heads * per_head}"
        )
    grouped = w.reshape(s.linear_num_key_heads, per_head, w.shape[-1])
    kd, vd = s.linear_key_head_dim, ratio * s.linear_value_head_dim
    q, k, v, z = grouped.split([kd, kd, vd, vd], dim=1)
    flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]
    return {"qkv": torch.cat(flat[:3]), "z": flat[3]}


def _split_ba(spec: ModelSpec, w: torch.Tensor, source: str) -> dict[str, torch.Tensor]:
    """Rows grouped by key head: [b of its value heads | a of them] per head."""
    s = spec
    ratio = s.linear_num_value_heads // s.linear_num_key_heads
    if w.shape[0] != 2 * s.linear_num_value_heads:
        raise WeightLoadError(
            f"checkpoint tensor {source!r} has {w.shape[0]} rows, expected {2 * s.linear_num_value_heads}"
        )
    b, a = w.reshape(s.linear_num_key_heads, 2 * ratio, w.shape[-1]).split(ratio, dim=1)
    return {"b": b.reshape(-1, w.shape[-1]), "a": a.reshape(-1, w.shape[-1])}


register(Qwen3Next("qwen3_next"))
register(Qwen3Hybrid("qwen3_5_moe"))
