"""--device resolution against a fake CUDA runtime that keeps torch's real contract:
`torch.cuda.set_device` refuses a device without an index (the boot failure of issue 8)."""

from __future__ import annotations

import pytest
import torch

from ferry.services.worker.boot import boot_worker
from ferry.services.worker.device import resolve_device, select_device
from ferry.services.worker.flags import WorkerBootConfig
from ferry.shared.errors import ConfigError


class FakeCuda:
    """Two visible devices, device 1 current; records what boot made current."""

    def __init__(self, count: int = 2, current: int = 1):
        self.count, self.current, self.selected = count, current, []

    def set_device(self, device) -> None:
        index = device.index if isinstance(device, torch.device) else device
        if index is None:  # what torch says for torch.device("cuda")
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        self.selected.append(index)

    def install(self, monkeypatch) -> "FakeCuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        return self


@pytest.mark.parametrize("name, index", [(None, 1), ("auto", 1), ("cuda", 1), ("cuda:0", 0), ("cuda:1", 1)])
def test_every_cuda_spelling_resolves_to_an_indexed_device(monkeypatch, name, index):
    fake = FakeCuda().install(monkeypatch)
    assert resolve_device(name) == torch.device("cuda", index)
    assert select_device(name) == torch.device("cuda", index)
    assert fake.selected == [index]


def test_a_missing_device_index_names_the_flag_and_the_visible_count(monkeypatch):
    FakeCuda(count=2).install(monkeypatch)
    with pytest.raises(
        ConfigError, match=r"--device cuda:2: there is no CUDA device 2; 2 are visible \(cuda:0 .. cuda:1"
    ):
        resolve_device("cuda:2")
    FakeCuda(count=1, current=0).install(monkeypatch)
    with pytest.raises(ConfigError, match="1 is visible"):
        resolve_device("cuda:1")


def test_cpu_and_bad_names():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="--device 'tpu'"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="--device 'gpu!' is not a device"):
        resolve_device("gpu!")


def test_cuda_without_a_cuda_device_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device("cuda")


class _BootReachedThePlan(Exception):
    pass


def test_boot_selects_an_indexed_device_for_the_default_flags(monkeypatch, tiny_model):
    """boot_worker with no --device on a (fake) CUDA host: it must make an *indexed* device
    current before anything else; the fake refuses what the real torch refused in issue 8."""
    fake = FakeCuda(count=1, current=0).install(monkeypatch)

    def stop(*_args, **_kwargs):
        raise _BootReachedThePlan

    monkeypatch.setattr("ferry.services.worker.boot.open_model", stop)  # boot's next step after the device
    with pytest.raises(_BootReachedThePlan):
        boot_worker(WorkerBootConfig(model=str(tiny_model)))  # every other field at its flag's default
    assert fake.selected == [0]


def test_graph_buckets_stop_at_the_pair_kernel_the_request_cap_and_the_copy_engine_steps():
    from ferry.services.worker.decode_graphs import graph_buckets

    assert graph_buckets(top_k=8, max_running_requests=64) == [1, 2, 4, 8]  # 64 pairs: the pair kernel's limit
    assert graph_buckets(top_k=8, max_running_requests=6) == [1, 2, 4, 6]
    assert graph_buckets(top_k=2, max_running_requests=64) == [1, 2, 4, 8, 16, 32]
    assert graph_buckets(top_k=8, max_running_requests=64, below=8) == [1, 2, 4, 7]
    assert graph_buckets(top_k=8, max_running_requests=64, below=1) == []
