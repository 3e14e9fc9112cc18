"""The three RMSNorm variants of the Qwen3 MoE family.

They differ in where the weight sits and in which dtype it is applied, and both matter for
parity in bf16: `RMSNorm` (qwen3_moe) scales the normalised input after casting it back to the
model dtype; `ZeroCenteredRMSNorm` (qwen3_next, qwen3_5_moe) stores w around 0, multiplies by
(1 + w) in float32 and casts last; `GatedRMSNorm` (Gated DeltaNet output) is a plain RMSNorm
followed by a SiLU gate computed in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * _normalise(x, self.eps).to(x.dtype)


class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_normalise(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = self.weight * _normalise(x, self.eps).to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


def make_norm(zero_centered: bool, dim: int, eps: float, dtype: torch.dtype, device=None) -> nn.Module:
    return (ZeroCenteredRMSNorm if zero_centered else RMSNorm)(dim, eps, dtype, device)
