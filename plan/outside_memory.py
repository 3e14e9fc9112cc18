"""Device memory a CUDA worker holds outside the plan's terms (docs/ARCHITECTURE.md §2, "The budget").

`--gpu-memory` is the whole process as nvidia-smi counts it. So the budget the planner fills is that
less what lives outside torch's caching allocator (the CUDA context, the kernels' loaded modules,
library handles), less what loads after the plan is made (warm-up's kernels), and, unless
`--memory-ratio` sets aside a share for it, less the allocator's headroom: steps of other shapes than
the profiled one may cut their blocks from fresh segments. The worker measures the first at boot;
`ferry plan`, on a machine without that GPU, estimates it. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ferry.shared.units import format_bytes

MiB = 2**20

# A booted worker's CUDA context and loaded modules, where NVML cannot say (and in `ferry plan`): a torch
# context with cuBLAS and the decode kernels loaded is 0.4-0.6 GiB; the larger end, so the estimate keeps
# the promise.
CUDA_CONTEXT_ESTIMATE = 640 * MiB
# Kernels first loaded after the plan is made (warm-up's shapes, the decode graphs' capture).
LATE_MODULES_MARGIN = 128 * MiB
# The caching allocator's headroom under the default ratio: 1 % of the device budget, at least 256 MiB.
ALLOCATOR_HEADROOM_MIN = 256 * MiB
ALLOCATOR_HEADROOM_FRACTION = 0.01


def allocator_headroom(base: int) -> int:
    return max(ALLOCATOR_HEADROOM_MIN, int(base * ALLOCATOR_HEADROOM_FRACTION))


@dataclass(frozen=True)
class OutsideMemory:
    """Bytes of the device budget the plan's terms may not take, and how they were found.

    `held`: the process's device memory outside the allocator when the plan is made (measured, or
    CUDA_CONTEXT_ESTIMATE); with the budget from free memory, only what it grew since free was read.
    `late`: what is expected to load after the plan (LATE_MODULES_MARGIN on CUDA)."""

    held: int = 0
    late: int = 0
    source: str = ""  # "measured" | "NVML" | "estimate"; "" on CPU, where nothing lives outside

    @property
    def bytes(self) -> int:
        return self.held + self.late

    def describe(self) -> str:
        if not self.bytes:
            return ""
        return (
            f"{format_bytes(self.bytes)} outside the allocator ({format_bytes(self.held)} CUDA context and kernels, "
            f"{self.source}, + {format_bytes(self.late)} for kernels loaded after the plan)"
        )


def estimated_outside(budget_from_free_memory: bool) -> OutsideMemory:
    """`ferry plan`'s estimate for a CUDA worker: the whole context against --gpu-memory; against free
    memory read by a process that already holds a context (as the worker reads it), only the late kernels."""
    held = 0 if budget_from_free_memory else CUDA_CONTEXT_ESTIMATE
    return OutsideMemory(held, LATE_MODULES_MARGIN, "estimate")
