"""A step's rotary tables in one Triton launch: cos and sin of position x frequency, [T, rotary_dim] each
(times YaRN's attention factor where the model scales them).

Twin: `RotaryEmbedding.cos_sin`'s torch sequence (services/worker/layers/rotary.py), the CPU path.
In torch it is six launches at the start of every step (the positions to float32, the product, cos,
its cast, sin, its cast), ~8 µs of a one-token decode step plus the gaps between them,
for a few hundred bytes. Here one program computes one token's row: the angle in float32 as torch
forms it (the position converted to float32 times the float32 frequency), its cos and sin with
libdevice's cosf and sinf (which torch's CUDA kernels call too), each rounded once to the dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import use_triton


@triton.jit
def _cos_sin_kernel(pos_ptr, freq_ptr, cos_ptr, sin_ptr, R, scaling, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_R)
    ok = offs < R
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + offs, mask=ok, other=0.0)
    ty = cos_ptr.dtype.element_ty
    # YaRN's attention factor, in float32 before the one rounding (1.0 elsewhere: an exact product)
    cos, sin = tl.cos(angle) * scaling, tl.sin(angle) * scaling
    tl.store(cos_ptr + t * R + offs, cos.to(ty), mask=ok)
    tl.store(sin_ptr + t * R + offs, sin.to(ty), mask=ok)


def rotary_cos_sin_triton(
    positions: torch.Tensor, inv_freq_both: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int64 [T] (contiguous), inv_freq_both float32 [R] -> (cos, sin), contiguous [T, R] in dtype."""
    if positions.dim() != 1 or not positions.is_contiguous() or inv_freq_both.dtype != torch.float32:
        raise ValueError(f"rotary_cos_sin: positions {tuple(positions.shape)}, frequencies {inv_freq_both.dtype}")
    t, r = positions.shape[0], inv_freq_both.shape[0]
    cos = torch.empty(t, r, dtype=dtype, device=positions.device)
    sin = torch.empty(t, r, dtype=dtype, device=positions.device)
    if t:
        _cos_sin_kernel[(t,)](positions, inv_freq_both, cos, sin, r, scaling, BLOCK_R=triton.next_power_of_2(r))
    return cos, sin


def rotary_cos_sin_reference(
    positions: torch.Tensor, inv_freq_both: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scaling` (YaRN's attention factor) multiplies cos and sin in float32, before their one rounding."""
    angles = positions.float()[:, None] * inv_freq_both[None, :]
    cos, sin = angles.cos(), angles.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq_both: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(positions) and positions.is_contiguous():
        return rotary_cos_sin_triton(positions, inv_freq_both, dtype, scaling)
    return rotary_cos_sin_reference(positions, inv_freq_both, dtype, scaling)
