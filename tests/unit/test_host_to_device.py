"""kernels/host_to_device.to_device: a list or a numpy array of any integer dtype arrives as the dtype asked."""

from __future__ import annotations

import numpy as np
import torch

from ferry.kernels.host_to_device import to_device


def test_lists_and_arrays_arrive_in_the_dtype_asked():
    for values in ([0, 3, 5], np.array([0, 3, 5], dtype=np.int64), np.array([0, 9, 3, 9, 5])[::2]):
        got = to_device(values, torch.int32, torch.device("cpu"))
        assert got.dtype == torch.int32 and got.tolist() == [0, 3, 5]
    pairs = to_device(np.stack([np.arange(3), np.arange(3)], axis=1)[::-1], torch.int64, torch.device("cpu"))
    assert pairs.tolist() == [[2, 2], [1, 1], [0, 0]]  # a negative-stride view is made contiguous first
