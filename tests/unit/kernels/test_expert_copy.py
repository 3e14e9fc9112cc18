"""The device-driven expert copy against its twin, through the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels.expert_copy import copy_experts_reference, copy_experts_triton


def _case(seed: int, experts=6, slots=5, inter=24, hidden=40):
    g = torch.Generator().manual_seed(seed)
    bank13 = torch.randn(experts, 2 * inter, hidden, generator=g).to(torch.bfloat16)
    bank2 = torch.randn(experts, hidden, inter, generator=g).to(torch.bfloat16)
    slots13 = torch.full((slots, 2 * inter, hidden), float("nan"), dtype=torch.bfloat16)
    slots2 = torch.full((slots, hidden, inter), float("nan"), dtype=torch.bfloat16)
    return bank13, bank2, slots13, slots2


@pytest.mark.parametrize("count, programs, block", [(0, 3, 64), (1, 1, 64), (3, 4, 128), (4, 7, 256)])
def test_copies_exactly_the_first_count_misses(count, programs, block):
    bank13, bank2, slots13, slots2 = _case(count)
    misses = torch.tensor([[4, 2], [0, 0], [5, 4], [1, 3], [2, 1]], dtype=torch.int32)  # the last rows are never read
    want13, want2 = slots13.clone(), slots2.clone()
    copy_experts_reference(bank13, bank2, want13, want2, misses, torch.tensor([count], dtype=torch.int32))
    copy_experts_triton(
        bank13, bank2, slots13, slots2, misses, torch.tensor([count], dtype=torch.int32), programs=programs, block=block
    )
    assert torch.equal(slots13.view(torch.int16), want13.view(torch.int16))  # NaN rows included: bit for bit
    assert torch.equal(slots2.view(torch.int16), want2.view(torch.int16))
    untouched = [s for s in range(5) if s not in misses[:count, 1].tolist()]
    assert torch.isnan(slots13[untouched].float()).all() and torch.isnan(slots2[untouched].float()).all()


def test_refuses_bad_miss_lists():
    bank13, bank2, slots13, slots2 = _case(0)
    with pytest.raises(ValueError, match="int32"):
        copy_experts_triton(
            bank13, bank2, slots13, slots2, torch.zeros(3, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="differ"):
        copy_experts_triton(
            bank13,
            bank2[:, :, :8].contiguous(),
            slots13,
            slots2,
            torch.zeros(3, 2, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
        )


def test_copies_only_the_used_prefix_of_each_row():
    """A GGUF mix's layer fills a prefix of rows sized for a larger layer's: only that prefix (rounded up to whole
    32-bit words) crosses, as the twin copies it, and the rest of each slot row stays as it was."""
    bank13, bank2, slots13, slots2 = _case(3)
    misses = torch.tensor([[4, 2], [0, 0], [5, 4]], dtype=torch.int32)
    count = torch.tensor([3], dtype=torch.int32)
    used = (1001, 640)  # 1001 bytes: 251 words, the last one's padding copied too
    want13, want2 = slots13.clone(), slots2.clone()
    copy_experts_reference(bank13, bank2, want13, want2, misses, count, used_bytes=used)
    copy_experts_triton(bank13, bank2, slots13, slots2, misses, count, programs=3, block=64, used_bytes=used)
    assert torch.equal(slots13.view(torch.int16), want13.view(torch.int16))
    assert torch.equal(slots2.view(torch.int16), want2.view(torch.int16))
    for slots, bank, words in ((slots13, bank13, 251), (slots2, bank2, 160)):
        got, source = slots.reshape(5, -1).view(torch.int32), bank.reshape(6, -1).view(torch.int32)
        assert torch.equal(got[2, :words], source[4, :words]) and torch.equal(got[4, :words], source[5, :words])
        assert torch.isnan(slots.reshape(5, -1)[[0, 2, 4], 2 * words :].float()).all(), "past the prefix: untouched"
    with pytest.raises(ValueError, match="used_bytes"):
        copy_experts_triton(bank13, bank2, slots13, slots2, misses, count, used_bytes=(4 * 24 * 40 + 4, 8))
