"""Reference twin of kernels/rms_norm.py: the three RMSNorm variants of the Qwen3 MoE family in plain
torch, the CPU path of the norm modules (services/worker/layers/norms.py) and of the Gated DeltaNet decode
twin (gated_deltanet_decode_reference.py).

Where the weight sits and in which dtype it is applied both matter for parity in bf16: plain (qwen3_moe)
scales the normalised input after casting it back to the model dtype; zero-centred (qwen3_next,
qwen3_5_moe) stores w around 0, multiplies by (1 + w) in float32 and casts last; gated (Gated DeltaNet's
output) is the plain one followed by a SiLU gate computed in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    if zero_centered:
        return (rms_normalise(x, eps) * (1.0 + weight.float())).to(x.dtype)
    return weight * rms_normalise(x, eps).to(x.dtype)


def gated_rms_norm_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = weight * rms_normalise(x, eps).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)
