"""`--device`: which device the worker runs on, resolved once, always with an index on CUDA.

`torch.cuda.set_device` (and every API that takes "the current device") needs an index: a bare
`cuda` device is refused ("Expected a torch.device with a specified index"). Boot, `ferry
generate`, the benchmarks and the CUDA tests all resolve through `resolve_device`, so none of them
can hold an unindexed CUDA device; `select_device` also makes it current, because Triton launches
on the current device whatever device its tensors are on.
"""

from __future__ import annotations

import torch

from ferry.shared.errors import ConfigError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str | None) -> torch.device:
    """`auto`/None: the current CUDA device if torch sees one, else the CPU; `cuda`: the current
    CUDA device; `cuda:N`: device N, which must exist. A CUDA result always carries its index."""
    if name is None or name == "auto":
        return _indexed_cuda(None, "auto") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--device {name!r} is not a device: use {DEVICE_CHOICES}") from exc
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ConfigError(f"--device {name!r}: Ferry runs on cpu or cuda ({DEVICE_CHOICES})")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch sees no CUDA device here (use --device cpu)")
    return _indexed_cuda(device.index, name)


def _indexed_cuda(index: int | None, name: str) -> torch.device:
    count = torch.cuda.device_count()
    if index is None:
        index = torch.cuda.current_device()
    if not 0 <= index < count:
        visible = f"cuda:0 .. cuda:{count - 1}" if count > 1 else "cuda:0"
        raise ConfigError(
            f"--device {name}: there is no CUDA device {index}; {count} "
            f"{'is' if count == 1 else 'are'} visible ({visible}; CUDA_VISIBLE_DEVICES renumbers them)"
        )
    return torch.device("cuda", index)


def select_device(name: str | None) -> torch.device:
    """`resolve_device`, made the current CUDA device when it is one."""
    device = resolve_device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
