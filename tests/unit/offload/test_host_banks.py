"""Host banks: layout, loading expert by expert, the deterministic dummy fill, the RAM-shortage error."""

import pytest
import torch

from ferry.services.worker.offload.host_memory.host_banks import (
    HostBanks,
    HostMemoryError,
    check_host_memory,
    mem_available_bytes,
)
from ferry.shared.units import GiB, MiB


def _meminfo(tmp_path, kib: int):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemFree:         1000 kB\nMemAvailable:   {kib} kB\n")
    return path


def test_load_expert_places_gate_up_and_down_in_one_contiguous_block_each():
    banks = HostBanks.allocate(
        num_layers=2, num_experts=3, hidden_size=8, intermediate_size=4, dtype=torch.float32, progress=False
    )
    gate, up, down = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8, 4)
    banks.load_expert(1, 2, gate, up, down)
    assert torch.equal(banks.w13[1][2][:4], gate) and torch.equal(banks.w13[1][2][4:], up)
    assert torch.equal(banks.w2[1][2], down)
    assert banks.w13[1][2].is_contiguous() and banks.w2[1][2].is_contiguous()
    assert banks.expert_nbytes == 3 * 4 * 8 * 4 and banks.nbytes == 6 * banks.expert_nbytes
    with pytest.raises(ValueError, match="down has shape"):
        banks.load_expert(0, 0, gate, up, down.t())


def test_dummy_fill_is_deterministic_and_experts_differ():
    def filled(seed):
        b = HostBanks.allocate(2, 4, 16, 8, torch.bfloat16, progress=False)
        b.fill_dummy(seed=seed, progress=False)
        return b

    a, b, c = filled(1), filled(1), filled(2)
    for layer in range(2):
        assert torch.equal(a.w13[layer], b.w13[layer]) and torch.equal(a.w2[layer], b.w2[layer])
        assert not torch.equal(a.w13[layer], c.w13[layer])
    experts = [a.w13[l][e] for l in range(2) for e in range(4)]
    assert all(not torch.equal(experts[i], experts[j]) for i in range(8) for j in range(i))
    std = a.w13[0].float().std().item()
    assert 0.01 < std < 0.04 and torch.isfinite(a.w2[1].float()).all()


def test_reading_mem_available(tmp_path):
    assert mem_available_bytes(_meminfo(tmp_path, 2048)) == 2048 * 1024
    assert mem_available_bytes(tmp_path / "missing") is None


def test_too_little_host_ram_is_a_clear_error_before_allocating(tmp_path):
    meminfo = _meminfo(tmp_path, 3 * GiB // 1024)  # 3 GiB available, 2 GiB of it kept in reserve
    with pytest.raises(HostMemoryError) as err:
        # 48 layers x 128 experts x 9 MiB would be 54 GiB: this must fail without touching memory
        HostBanks.allocate(48, 128, 2048, 768, torch.bfloat16, progress=False, meminfo=meminfo)
    message = str(err.value)
    assert "54.00 GiB" in message and "3.00 GiB is available" in message and "MemAvailable" in message
    check_host_memory(512 * MiB, "small banks", meminfo)  # fits: no error


def test_banks_for_a_model_spec(tmp_path):
    from ferry.plan.model_config import load_model_config

    spec = load_model_config("tests/data/models/qwen3-30b-a3b")
    with pytest.raises(HostMemoryError, match="host banks for 48 MoE layers x 128 experts"):
        HostBanks.for_model(spec, "bfloat16", progress=False, meminfo=_meminfo(tmp_path, 1024 * 1024))
