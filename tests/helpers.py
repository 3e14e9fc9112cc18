"""Paths and small builders shared by tests."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"
REAL_MODELS = DATA / "models"
QWEN3_30B = REAL_MODELS / "qwen3-30b-a3b"
QWEN3_6_35B = REAL_MODELS / "qwen3.6-35b-a3b"
GLM_4_5_AIR = REAL_MODELS / "glm-4.5-air"


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


# --gpu-memory counts the whole process (plan/outside_memory.py): a CUDA test process that has booted many workers
# holds the context and every kernel they loaded (1.36 GiB by NVML in one check), so its small budgets add this.
CUDA_TEST_PROCESS_BYTES = 3 * 2**30


def cuda_test_budget(plan_bytes: int) -> str:
    """--gpu-memory for a CUDA test boot whose plan should get about `plan_bytes`."""
    return f"{plan_bytes + CUDA_TEST_PROCESS_BYTES}B"
