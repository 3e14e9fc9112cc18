"""The checkpoint layout every expert format is written from: gate and up [I, H], down [H, I]."""

from __future__ import annotations

from typing import NamedTuple


class ExpertBias(NamedTuple):
    """An expert's biases (gpt-oss): gate/up [2I] (the gate's, then the up's) and down [H]."""

    gate_up: object  # torch.Tensor [2I]
    down: object  # torch.Tensor [H]


def check_expert_shapes(where: str, gate, up, down, inter: int, hidden: int) -> None:
    """An expert in checkpoint layout: gate and up [I, H], down [H, I] (tensors or QuantizedWeights,
    by their logical shape); a ValueError naming `where` and the tensor."""
    for name, t, shape in (
        ("gate", gate, (inter, hidden)),
        ("up", up, (inter, hidden)),
        ("down", down, (hidden, inter)),
    ):
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape}")
