"""Rotary position embedding on the first `rotary_dim` channels of each head (partial rotary).

Half-split convention (rotate_half), frequencies base^(-2i/rotary_dim) computed in float32 as the
reference does. qwen3_5_moe's multimodal RoPE (mrope) reduces to this for text, where the
temporal, height and width position ids are all the token position. YaRN scaling (`yarn`, gpt-oss) changes
the frequencies and multiplies cos and sin by its attention factor, as transformers' rope utilities do."""

from __future__ import annotations

import math

import torch
from torch import nn

from ferry.kernels.rotary_cos_sin import rotary_cos_sin
from ferry.plan.model_spec import YarnRope


def yarn_inv_freq(rotary_dim: int, theta: float, yarn: YarnRope, device=None) -> tuple[torch.Tensor, float]:
    """(frequencies, attention factor) of YaRN: the dimensions that turn more than `beta_fast` times over the
    original context keep their frequency, those under `beta_slow` are divided by `factor`, a linear ramp
    between; transformers' `_compute_yarn_parameters` step for step (float32)."""

    def correction_dim(rotations: float) -> float:
        original = yarn.original_max_position_embeddings
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    factor = yarn.attention_factor
    if factor is None:
        factor = 0.1 * math.log(yarn.factor) + 1.0 if yarn.factor > 1 else 1.0
    return inv_freq, float(factor)


class RotaryEmbedding(nn.Module):
    """`proportional` (Gemma 4's full layers, rope_type "proportional"): the whole head turns as pairs (i, i +
    head_dim / 2) at frequencies theta^(-2i / head_dim) for the first int(partial_rotary_factor * head_dim // 2)
    pairs and 0 (cos 1, sin 0: unturned) for the rest, as transformers' `_compute_proportional_rope_parameters`."""

    table_index = 0  # its (cos, sin) in a step's StepContext.tables (models/decoder.py numbers a model's rotaries)

    def __init__(
        self,
        head_dim: int,
        partial_rotary_factor: float,
        theta: float,
        device=None,
        yarn: YarnRope | None = None,
        proportional: bool = False,
    ):
        super().__init__()
        self.rotary_dim = head_dim if proportional else int(head_dim * partial_rotary_factor)
        self.scaling = 1.0  # cos and sin are multiplied by it (YaRN's attention factor)
        if proportional:
            if yarn is not None:
                raise ValueError("proportional rotary takes no YaRN scaling")
            angles = int(partial_rotary_factor * head_dim // 2)
            turned = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32, device=device) / head_dim))
            inv_freq = torch.cat([turned, torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)])
        elif yarn is None:
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            inv_freq = 1.0 / (theta**exponents)
        else:
            inv_freq, self.scaling = yarn_inv_freq(self.rotary_dim, theta, yarn, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # the frequencies twice over (rotate_half's two halves), so a step's angles need no cat
        self.register_buffer("inv_freq_both", self.inv_freq.repeat(2), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, rotary_dim] each, in the model dtype: one launch on the Triton path (kernels/rotary_cos_sin.py,
        within an ulp of the torch twin's values), the torch twin elsewhere."""
        return rotary_cos_sin(positions, self.inv_freq_both, dtype, self.scaling)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; only the first rotary_dim channels turn."""
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        turned = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
        return torch.cat([turned, passthrough], dim=-1)
