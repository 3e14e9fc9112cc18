"""Paths and small builders shared by tests."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).parent / "data"
REAL_MODELS = DATA / "models"
QWEN3_30B = REAL_MODELS / "qwen3-30b-a3b"
QWEN3_6_35B = REAL_MODELS / "qwen3.6-35b-a3b"


def cuda_plan_budget(gpu_memory: int) -> int:
    """`ferry plan --gpu-memory X`'s budget under the default ratio: X less the estimated CUDA context, the kernels
    loaded after the plan and the allocator's headroom (plan/outside_memory.py)."""
    from ferry.plan.outside_memory import CUDA_CONTEXT_ESTIMATE, LATE_MODULES_MARGIN, allocator_headroom

    return gpu_memory - CUDA_CONTEXT_ESTIMATE - LATE_MODULES_MARGIN - allocator_headroom(gpu_memory)
