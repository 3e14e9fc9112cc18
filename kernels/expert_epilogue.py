"""What an expert computes besides its two products, where the model says so: biases on the gate/up and down
projections and the activation between them (silu(gate) * up, gpt-oss's clamped SwiGLU, or Gemma's
gelu_tanh(gate) * up).

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
    g = gate.clamp(max=limit), u = up.clamp(-limit, limit), (u + 1) * g * sigmoid(alpha * g). With `gelu_tanh`,
    gelu(gate) * up with gelu's tanh approximation (Gemma's experts: transformers' gelu_pytorch_tanh)."""

    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    gelu_tanh: bool = False

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.gelu_tanh:
            return F.gelu(gate, approximate="tanh") * up
        if not self.swiglu_limit:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))


SILU_AND_MUL = ExpertActivation()
GELU_TANH_AND_MUL = ExpertActivation(gelu_tanh=True)


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


# the expert kernels' `SWIGLU` constexpr is the activation's code (`activation_code`): 0 silu(gate) * up, 1 the
# clamped SwiGLU, 2 gelu_tanh(gate) * up; the host's C kernel takes the same codes (expert_job.h's ferry_activation)
SILU_CODE, SWIGLU_CODE, GELU_TANH_CODE = 0, 1, 2


def activation_code(activation: ExpertActivation) -> int:
    if activation.gelu_tanh:
        return GELU_TANH_CODE
    return SWIGLU_CODE if activation.swiglu_limit else SILU_CODE


@triton.jit
def gate_up_activation(
    gate, up, bias_gate, bias_up, alpha, limit, out_ty, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr
):
    """The Triton expert kernels' activation: `gate`, `up` the float32 projections, each rounded here to
    `out_ty` as the reference rounds them, then with HAS_BIAS their biases (float32, broadcastable) added and
    rounded, then by SWIGLU's code silu(gate) * up, `ExpertActivation`'s clamped SwiGLU or gelu_tanh(gate) * up,
    every op rounded to `out_ty` as torch rounds it in that dtype (torch computes gelu in float32 and rounds
    once). Returns the activation in `out_ty`."""
    gate = gate.to(out_ty).to(tl.float32)
    up = up.to(out_ty).to(tl.float32)
    if HAS_BIAS:
        gate = (gate + bias_gate).to(out_ty).to(tl.float32)
        up = (up + bias_up).to(out_ty).to(tl.float32)
    if SWIGLU == 2:  # torch's tanh approximation: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        gelu = (0.5 * gate * (1.0 + tanh)).to(out_ty).to(tl.float32)
        return (gelu * up).to(out_ty)
    if SWIGLU == 1:
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
        SWIGLU=activation_code(activation),
    )
    return w13, w2, b13 if has_bias else w13, b2 if has_bias else w2, args
