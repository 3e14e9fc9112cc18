"""Rotary position embedding on the first `rotary_dim` channels of each head (partial rotary).

Half-split convention (rotate_half), frequencies base^(-2i/rotary_dim) computed in float32 as the
reference does. qwen3_5_moe's multimodal RoPE (mrope) reduces to this for text, where the
temporal, height and width position ids are all the token position."""

from __future__ import annotations

import torch
from torch import nn

from ferry.kernels.rotary_cos_sin import rotary_cos_sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, partial_rotary_factor: float, theta: float, device=None):
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)
        # the frequencies twice over (rotate_half's two halves), so a step's angles need no cat
        self.register_buffer("inv_freq_both", self.inv_freq.repeat(2), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, rotary_dim] each, in the model dtype: one launch on the Triton path (kernels/rotary_cos_sin.py,
        within an ulp of the torch twin's values), the torch twin elsewhere."""
        return rotary_cos_sin(positions, self.inv_freq_both, dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; only the first rotary_dim channels turn."""
        rot, passthrough = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        turned = rot * cos[:, None, :] + rotated_half * sin[:, None, :]
        return torch.cat([turned, passthrough], dim=-1)
