"""Experts packed to 12 bits a value (kernels/expert_pack.py): lossless, and the GPU's unpacking
copy for an expert list held on the device or given by the host, through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels.expert_pack import pack_experts, unpack_expert_reference, unpack_experts_triton
from ferry.plan.expert_formats.bf16_packed import PACKED_ESCAPE_BYTES, packed_expert_bytes

I, H = 4, 8  # w13 [8, 8] = 64 values, w2 [8, 4] = 32


def _experts(seed: int, n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(n, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(n, H, I, generator=g) * 0.002).to(torch.bfloat16)
    # what falls outside a family's window: zeros of both signs, a subnormal, a tiny value, inf, NaN
    specials = torch.tensor([0.0, -0.0, 1e-40, 3e-9, float("inf"), float("nan")]).to(torch.bfloat16)
    w13[1, 1, :6] = specials
    w2[1, 2, :2] = specials[4:]
    w13[3, 0, 0] = 1e30  # a huge value moves expert 3's w13 window up: most of its values escape
    return w13, w2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).reshape(-1)


def _layer(w13, w2) -> dict:
    p = pack_experts(w13, w2)
    offsets = torch.zeros(w13.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(p["counts"], 0)
    return {**p, "esc_offsets": offsets}


def _reference(p: dict, e: int, v13: int) -> torch.Tensor:
    a, b = int(p["esc_offsets"][e]), int(p["esc_offsets"][e + 1])
    return unpack_expert_reference(p["lo"][e], p["hi"][e], p["base"][e], p["esc_index"][a:b], p["esc_bits"][a:b], v13)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packing_restores_every_bit_and_takes_12_bits_a_value(seed):
    w13, w2 = _experts(seed)
    p = _layer(w13, w2)
    v13 = w13[0].numel()
    for e in range(5):
        assert torch.equal(_bits(_reference(p, e, v13)), torch.cat([_bits(w13[e]), _bits(w2[e])])), e
    counts = p["counts"]
    assert counts[1] == 6 and counts[3] > 48  # the specials but the zeros; expert 3's window sits above its values
    assert int(counts[[0, 2, 4]].sum()) <= 3  # normal families: a value below the window is rare
    assert p["lo"].numel() + p["hi"].numel() == (w13.numel() + w2.numel()) * 3 // 2
    assert (p["base"][:, 0] > p["base"][:, 1])[[0, 2, 4]].all()  # each family its own window: w2 is smaller


def test_a_normal_expert_packs_to_three_quarters_of_its_bytes():
    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(4, 128, 96, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(4, 96, 64, generator=g) * 0.002).to(torch.bfloat16)
    p = pack_experts(w13, w2)
    values = 128 * 96 + 96 * 64
    assert p["lo"].shape == (4, values) and p["hi"].shape == (4, values // 2) and p["base"].shape == (4, 2)
    held = sum(p[k].nbytes for k in ("lo", "hi", "base", "esc_index", "esc_bits"))  # what the banks keep
    assert held == 4 * packed_expert_bytes(values) + PACKED_ESCAPE_BYTES * int(
        p["counts"].sum()
    )  # as the plan prices it
    assert int(p["counts"].sum()) < 4 * values // 512 and held < 0.76 * (w13.nbytes + w2.nbytes)


def test_packing_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="bf16"):
        pack_experts(torch.zeros(2, 8, 4), torch.zeros(2, 4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_experts(torch.zeros(2, 2, 3, dtype=torch.bfloat16), torch.zeros(2, 3, 2, dtype=torch.bfloat16))


def _slots(n: int = 6):
    nan = float("nan")
    return (torch.full((n, 2 * I, H), nan, dtype=torch.bfloat16), torch.full((n, H, I), nan, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "count, programs, block, escape_block", [(0, 2, 4, 128), (1, 1, 4, 2), (3, 3, 8, 4), (4, 5, 16, 1), (5, 2, 64, 128)]
)
def test_the_unpacking_copy_writes_exactly_the_first_count_listed_experts(count, programs, block, escape_block):
    w13, w2 = _experts(count + 10)
    p = _layer(w13, w2)
    s13, s2 = _slots()
    listed = torch.tensor([[1, 4], [3, 0], [0, 2], [4, 5], [2, 1], [0, 3]], dtype=torch.int32)  # the last never read
    unpack_experts_triton(
        p["lo"],
        p["hi"],
        p["base"],
        p["esc_offsets"],
        p["esc_index"],
        p["esc_bits"],
        s13,
        s2,
        listed,
        torch.tensor([count], dtype=torch.int32),
        programs=programs,
        block=block,
        escape_block=escape_block,
    )
    for e, s in listed[:count].tolist():
        assert torch.equal(_bits(s13[s]), _bits(w13[e])) and torch.equal(_bits(s2[s]), _bits(w2[e])), (e, s)
    untouched = [s for s in range(6) if s not in listed[:count, 1].tolist()]
    assert torch.isnan(s13[untouched].float()).all() and torch.isnan(s2[untouched].float()).all()


@pytest.mark.parametrize("count", [0, 2, 3])
def test_a_host_count_fills_consecutive_slots_from_an_expert_list(count):
    w13, w2 = _experts(5)
    p = _layer(w13, w2)
    s13, s2 = _slots()
    experts = torch.tensor([3, 1, 4, 0], dtype=torch.int32)
    unpack_experts_triton(
        p["lo"],
        p["hi"],
        p["base"],
        p["esc_offsets"],
        p["esc_index"],
        p["esc_bits"],
        s13,
        s2,
        experts,
        count,
        slot0=2,
        programs=3,
        block=8,
    )
    for i, e in enumerate(experts[:count].tolist()):
        assert torch.equal(_bits(s13[2 + i]), _bits(w13[e])) and torch.equal(_bits(s2[2 + i]), _bits(w2[e]))
    assert torch.isnan(s13[[s for s in range(6) if not 2 <= s < 2 + count]].float()).all()


def test_the_unpacking_copy_refuses_bad_arguments():
    w13, w2 = _experts(3)
    p = _layer(w13, w2)
    args = (p["lo"], p["hi"], p["base"], p["esc_offsets"], p["esc_index"], p["esc_bits"])
    s13, s2 = _slots()
    with pytest.raises(ValueError, match="int32"):
        unpack_experts_triton(*args, s13, s2, torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="slot0"):
        unpack_experts_triton(*args, s13, s2, torch.zeros(3, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="values"):
        unpack_experts_triton(*args, s13[:, :4].contiguous(), s2, torch.zeros(1, 2, dtype=torch.int32), 1)
