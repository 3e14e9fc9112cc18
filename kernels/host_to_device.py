"""Small host arrays (index lists, lengths, per-row scalars) sent to the device without the host waiting.

A pageable host-to-device copy synchronises with the device: the launching thread would stop until every
kernel queued before it has run, and could no longer run ahead of the GPU. A copy from pinned memory is
queued like a kernel (the caching host allocator keeps the pinned block until the copy has run), so on
CUDA the values go through it; elsewhere they are copied plainly."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list or a numpy array) as a `dtype` tensor on `device`, queued without waiting."""
    host = (
        torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        if isinstance(values, np.ndarray)
        else torch.tensor(values, dtype=dtype)
    )
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
