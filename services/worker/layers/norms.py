"""The three RMSNorm variants of the Qwen3 MoE family.

They differ in where the weight sits and in which dtype it is applied, and both matter for
parity in bf16: `RMSNorm` (qwen3_moe) scales the normalised input after casting it back to the
model dtype; `ZeroCenteredRMSNorm` (qwen3_next, qwen3_5_moe) stores w around 0, multiplies by
(1 + w) in float32 and casts last; `GatedRMSNorm` (Gated DeltaNet output) is a plain RMSNorm
followed by a SiLU gate computed in float32.

All three run as one Triton kernel on CUDA (kernels/rms_norm.py), and on CPU as its reference
twin (kernels/rms_norm_reference.py). `forward_add(x, residual)` is the
pre-norm residual step `residual = residual + x; return norm(residual), residual`, fused into that
one kernel on CUDA (bit for bit what adding first and normalising after gives on CPU), and x
may be a MoE block's unsummed rows, which the kernel sums first."""

from __future__ import annotations

import torch
from torch import nn

from ferry.kernels.dispatch import use_triton
from ferry.kernels.expert_rows_sum import ExpertRows, summed
from ferry.kernels.rms_norm import rms_norm_triton
from ferry.kernels.rms_norm_reference import gated_rms_norm_reference, rms_norm_reference


class _FusableRMSNorm(nn.Module):
    zero_centered = False

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        identity = torch.zeros if self.zero_centered else torch.ones
        self.weight = nn.Parameter(identity(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            return rms_norm_triton(x, self.weight, self.eps, self.zero_centered)
        return self.reference(x)

    def forward_add(self, x: torch.Tensor | ExpertRows, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); x may be a MoE block's unsummed rows (ExpertRows),
        which the kernel sums as `sum_rows` would (kernels/expert_rows_sum.py)."""
        if use_triton(residual):
            return rms_norm_triton(x, self.weight, self.eps, self.zero_centered, residual)
        residual = residual + summed(x)
        return self.reference(residual), residual

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps, self.zero_centered)


class RMSNorm(_FusableRMSNorm):
    pass


class ZeroCenteredRMSNorm(_FusableRMSNorm):
    zero_centered = True


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if use_triton(x) and x.stride(-1) == 1 and gate.stride(-1) == 1 and x.dim() in (2, 3):
            return rms_norm_triton(x, self.weight, self.eps, False, gate=gate)
        return self.reference(x, gate)

    def reference(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm_reference(x, gate, self.weight, self.eps)


def make_norm(zero_centered: bool, dim: int, eps: float, dtype: torch.dtype, device=None) -> _FusableRMSNorm:
    return (ZeroCenteredRMSNorm if zero_centered else RMSNorm)(dim, eps, dtype, device)
