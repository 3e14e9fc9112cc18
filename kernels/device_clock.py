"""A device-side timestamp: one thread writes the GPU's global nanosecond timer into a slot.

Copies inside a CUDA graph cannot be timed with timing events (a captured event records no
time), so the expert store stamps the start and end of its copies, and the moment the compute
stream is ready for them, from kernels launched in stream order; the host reads the stamps once
the step is over. CUDA only (there is no timer to read in the interpreter)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["index"])  # one variant for every stamp column
def _stamp_kernel(out_ptr, index):
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr + index, now)


def stamp(out: torch.Tensor, index: int) -> None:
    """out[index] = the device's global timer (ns), when the current stream reaches this point."""
    _stamp_kernel[(1,)](out, index, num_warps=1)
