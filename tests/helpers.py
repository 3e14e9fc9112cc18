"""Paths and small builders shared by tests."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"
REAL_MODELS = DATA / "models"
QWEN3_30B = REAL_MODELS / "qwen3-30b-a3b"
QWEN3_6_35B = REAL_MODELS / "qwen3.6-35b-a3b"


def order_model():
    """A Pydantic model with a nested list of items, as an agent declares a tool or an output format: its
    JSON schema puts Item under $defs and refers to it (`{"$ref": "#/$defs/Item"}`). Every field is
    bounded, so even a random-weight model's output under its grammar ends within a few dozen tokens."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field

    class Item(BaseModel):
        model_config = ConfigDict(extra="forbid")  # additionalProperties false: no keys beyond these
        part: Literal["bolt", "nut", "gear"]
        qty: Literal[1, 2, 3]

    class Order(BaseModel):
        model_config = ConfigDict(extra="forbid")
        items: list[Item] = Field(min_length=1, max_length=3)
        rush: bool

    return Order


def cuda_plan_budget(gpu_memory: int) -> int:
    """`ferry plan --gpu-memory X`'s budget under the default ratio: X less the estimated CUDA context, the kernels
    loaded after the plan and the allocator's headroom (plan/outside_memory.py)."""
    from ferry.plan.outside_memory import CUDA_CONTEXT_ESTIMATE, LATE_MODULES_MARGIN, allocator_headroom

    return gpu_memory - CUDA_CONTEXT_ESTIMATE - LATE_MODULES_MARGIN - allocator_headroom(gpu_memory)
