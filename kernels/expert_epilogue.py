"""What an expert computes besides its two products, where the model says so: biases on the gate/up and down
projections and the activation between them (silu(gate) * up, or gpt-oss's clamped SwiGLU).

A slot family whose expert has such an epilogue is read by the expert kernels as an `EpilogueFamily` (the
format's `gemm_views` gives it: services/worker/expert_formats/bf16.py), the plain weight tensor otherwise;
the biases are views of rows the slot holds after its weights, so they move with every copy of the expert.
The reference twin (grouped_expert_gemm_reference.py) computes them; the Triton expert kernels and the host's
C kernel do not yet, and the places that would hand them one refuse it (plan/expert_backend.py,
services/worker/expert_formats/bf16.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertActivation:
    """silu(gate) * up where `swiglu_limit` is 0; else the clamped SwiGLU of transformers' GptOssExperts:
    g = gate.clamp(max=limit), u = up.clamp(-limit, limit), (u + 1) * g * sigmoid(alpha * g)."""

    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not self.swiglu_limit:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))


SILU_AND_MUL = ExpertActivation()


@dataclass(frozen=True)
class EpilogueFamily:
    """One weight family of the slots with its epilogue: `weight` [S, R, C] (a view of the slot rows), `bias`
    [S, R] or None, and for the gate/up family the `activation` applied to its output."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    activation: ExpertActivation = SILU_AND_MUL

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


def family_parts(family) -> tuple[torch.Tensor, torch.Tensor | None, ExpertActivation]:
    """(weight, bias or None, activation) of a plain weight tensor or an EpilogueFamily."""
    if isinstance(family, EpilogueFamily):
        return family.weight, family.bias, family.activation
    return family, None, SILU_AND_MUL
