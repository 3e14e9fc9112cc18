"""Which implementation a kernel call takes: Triton for CUDA tensors, the plain-torch twin elsewhere.

`FERRY_TRITON_ON_CPU=1` together with `TRITON_INTERPRET=1` sends CPU tensors down the Triton
paths too, through the interpreter: slow, but it runs the exact kernel sequence a GPU step
launches on a machine without one (end-to-end checks of the CUDA path, launch counting)."""

from __future__ import annotations

import os

import torch

_TRITON_ON_CPU = os.environ.get("FERRY_TRITON_ON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _TRITON_ON_CPU
