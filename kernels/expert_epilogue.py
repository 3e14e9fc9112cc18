"""What an expert computes besides its two products, where the model says so: biases on the gate/up and down
projections and the activation between them (silu(gate) * up, or gpt-oss's clamped SwiGLU).

A slot family whose expert has such an epilogue is read by the expert kernels as an `EpilogueFamily` (the
format's `gemm_views` gives it: services/worker/expert_formats/bf16.py), the plain weight tensor otherwise;
the biases are views of rows the slot holds after its weights, so they move with every copy of the expert.
The reference twin (grouped_expert_gemm_reference.py) computes them, and so do the Triton expert kernels
(grouped_expert_gemm.py, expert_pair_gemv.py: `gate_up_activation` and `triton_epilogue_args` here) and the host's
kernels (kernels/host_experts_c/host_experts.c's `combine`, with the same roundings, and the torch host path:
services/worker/offload/host_compute/); formats whose rows hold no biases are kept from such experts
(plan/model_config.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


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


@triton.jit
def gate_up_activation(
    gate, up, bias_gate, bias_up, alpha, limit, out_ty, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr
):
    """The Triton expert kernels' activation: `gate`, `up` the float32 projections, each rounded here to
    `out_ty` as the reference rounds them, then with HAS_BIAS their biases (float32, broadcastable) added and
    rounded, then silu(gate) * up, or with SWIGLU `ExpertActivation`'s clamped SwiGLU, every op rounded to
    `out_ty` as torch rounds it in that dtype. Returns the activation in `out_ty`."""
    gate = gate.to(out_ty).to(tl.float32)
    up = up.to(out_ty).to(tl.float32)
    if HAS_BIAS:
        gate = (gate + bias_gate).to(out_ty).to(tl.float32)
        up = (up + bias_up).to(out_ty).to(tl.float32)
    if SWIGLU:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        scaled = (gate * alpha).to(out_ty).to(tl.float32)
        sigmoid = (1.0 / (1.0 + tl.exp(-scaled))).to(out_ty).to(tl.float32)
        glu = (gate * sigmoid).to(out_ty).to(tl.float32)
        return ((up + 1.0).to(out_ty).to(tl.float32) * glu).to(out_ty)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    return (silu * up).to(out_ty)


def triton_epilogue_args(w13, w2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """(w13 weight, w2 weight, w13 bias, w2 bias, the kernels' epilogue arguments) of plain tensors or
    EpilogueFamily views: without biases the bias pointers are the weights, never read."""
    w13, b13, activation = family_parts(w13)
    w2, b2, _ = family_parts(w2)
    if (b13 is None) != (b2 is None):
        raise ValueError("an expert's gate/up and down projections have biases both or neither")
    has_bias = b13 is not None
    if has_bias and (b13.stride(1) != 1 or b2.stride(1) != 1):
        raise ValueError("expert biases must be unit-stride along their rows")
    args = dict(
        stride_b13=b13.stride(0) if has_bias else 0,
        stride_b2=b2.stride(0) if has_bias else 0,
        alpha=float(activation.swiglu_alpha),
        limit=float(activation.swiglu_limit),
        HAS_BIAS=has_bias,
        SWIGLU=bool(activation.swiglu_limit),
    )
    return w13, w2, b13 if has_bias else w13, b2 if has_bias else w2, args
