"""The worker's device memory outside torch's caching allocator (plan/outside_memory.py says why it matters).

nvidia-smi counts a process's whole device memory: the CUDA context, loaded kernel modules and library
handles besides the allocator's segments. Where NVML lists this process (nvidia-ml-py installed, no pid
namespace between it and the driver), that figure less the allocator's reserved bytes is exact. Elsewhere
the context is taken as CUDA_CONTEXT_ESTIMATE, and what it grows by (kernels loaded later) is read from the
device's own free memory, which counts every process: other processes are assumed not to change meanwhile."""

from __future__ import annotations

import os

import torch

from ferry.plan.outside_memory import CUDA_CONTEXT_ESTIMATE, LATE_MODULES_MARGIN, OutsideMemory


def nvml_process_bytes(device: torch.device) -> int | None:
    """This process's device memory as NVML (and so nvidia-smi) counts it; None where NVML cannot say."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            index = torch.cuda._get_nvml_device_index(device)
        except (AttributeError, RuntimeError):
            index = device.index or 0
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None
    except pynvml.NVMLError:
        return None


class OutsideAllocatorProbe:
    """Reads the process's memory outside the allocator; made once CUDA is up, before anything is loaded."""

    def __init__(self, device: torch.device):
        self.device = device
        self._start_outside = self._device_wide_outside()
        self.nvml = nvml_process_bytes(device) is not None
        self.at_start = self.held()  # the context before any weight: what free memory, read now, excludes

    def _device_wide_outside(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free - torch.cuda.memory_reserved(self.device)

    def held(self) -> int:
        """The process's device memory outside the allocator now."""
        if self.nvml:
            used = nvml_process_bytes(self.device)
            if used is not None:
                return max(0, used - torch.cuda.memory_reserved(self.device))
        return CUDA_CONTEXT_ESTIMATE + max(0, self._device_wide_outside() - self._start_outside)

    def outside(self, budget_from_gpu_memory: bool) -> OutsideMemory:
        """What the plan leaves room for: against --gpu-memory all that is held, against the free memory read at
        start only what was added since; kernels loaded after the plan on top."""
        held = self.held()
        if not budget_from_gpu_memory:
            held = max(0, held - self.at_start)
        return OutsideMemory(held, LATE_MODULES_MARGIN, "NVML" if self.nvml else "device free memory")
