"""The checkpoint layout every expert format is written from: gate and up [I, H], down [H, I]."""

from __future__ import annotations


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
