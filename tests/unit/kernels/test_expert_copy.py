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
