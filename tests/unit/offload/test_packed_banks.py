"""Packed host banks (services/worker/offload/host_memory/packed_banks.py) against the plain ones, on CPU: the same
bits for dummy fills and loaded experts, copied into slots from a host list (reference) or a device
list (the unpacking kernel, interpreted), a reload after sealing, the sizes the plan prices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferry.plan import host_memory as H
from ferry.services.worker.offload.host_memory.host_banks import HostBanks, HostMemoryError
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks

SHAPE = (2, 5, 32, 16, torch.bfloat16)  # layers, experts, hidden, intermediate


def _pair(seed: int = 3) -> tuple[HostBanks, PackedHostBanks]:
    plain = HostBanks.allocate(*SHAPE, pin=False, progress=False)
    packed = PackedHostBanks.allocate(*SHAPE, pin=False, progress=False)
    plain.fill_dummy(seed=seed, progress=False)
    packed.fill_dummy(seed=seed, progress=False)
    return plain, packed


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _assert_slot(s13, s2, slot, plain, layer, expert):
    assert torch.equal(_bits(s13[slot]), _bits(plain.w13[layer][expert])), (slot, layer, expert)
    assert torch.equal(_bits(s2[slot]), _bits(plain.w2[layer][expert])), (slot, layer, expert)


def test_a_dummy_fill_holds_the_plain_banks_bits_in_three_quarters_of_the_bytes():
    plain, packed = _pair()
    for layer in range(2):
        for e in range(5):
            w13, w2 = packed.expert(layer, e)
            assert torch.equal(_bits(w13), _bits(plain.w13[layer][e])) and torch.equal(
                _bits(w2), _bits(plain.w2[layer][e])
            )
    assert packed.expert_nbytes < 0.76 * plain.expert_nbytes
    values = 3 * 32 * 16
    assert packed.nbytes <= H.packed_bank_bytes(2, 5, values)  # within what the plan priced
    assert H.expert_bank_bytes(_spec(), "bfloat16", "packed") == H.packed_bank_bytes(2, 5, values)


def _spec():
    from offload_tiny import tiny_spec

    return tiny_spec(layers=2, experts=5, hidden=32, inter=16)


@pytest.mark.parametrize("device_list", [False, True])
def test_copies_into_slots_give_the_plain_bits_after_a_reload_with_escapes(device_list):
    plain, packed = _pair()
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(16, 32, generator=g).bfloat16() for _ in range(2))
    down = torch.randn(32, 16, generator=g).bfloat16()
    gate[0, :6] = torch.tensor([0.0, -0.0, 1e-40, float("inf"), float("nan"), 1e30])
    down[3, 3] = 3e-30  # far below its family's window
    packed.seal()  # then a reload: the escapes are laid out again before the next copy
    for banks in (plain, packed):
        banks.load_expert(1, 2, gate, up, down)
    assert packed.escape_count >= 3
    assert packed.escape_count == sum(
        len(packed._escapes[l][e][0]) for l in range(2) for e in range(5)
    )  # kept, not recounted
    s13 = torch.full((4, 32, 32), float("nan"), dtype=torch.bfloat16)
    s2 = torch.full((4, 32, 16), float("nan"), dtype=torch.bfloat16)
    pairs = [(2, 3), (0, 1), (4, 0)]
    if device_list:  # the unpacking kernel (interpreted), count held in a tensor as on the GPU
        packed.copy_listed(
            1,
            s13,
            s2,
            torch.tensor(pairs, dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32),
            programs=3,
            block=64,
        )
    else:
        packed.copy_experts(1, pairs, s13, s2)
    for e, s in pairs:
        _assert_slot(s13, s2, s, plain, 1, e)
    assert torch.isnan(s13[2].float()).all()


def test_loading_refuses_wrong_shapes_and_banks_refuse_other_dtypes_and_too_little_ram(tmp_path):
    _, packed = _pair()
    with pytest.raises(ValueError, match="down has shape"):
        packed.load_expert(0, 0, torch.zeros(16, 32), torch.zeros(16, 32), torch.zeros(16, 32))
    with pytest.raises(ValueError, match="bf16"):
        PackedHostBanks.allocate(2, 5, 32, 16, torch.float32, pin=False, progress=False)
    meminfo = Path(tmp_path) / "meminfo"
    meminfo.write_text("MemAvailable:    1048576 kB\n")  # 1 GiB
    with pytest.raises(HostMemoryError, match="packed host banks"):
        PackedHostBanks.allocate(48, 128, 2048, 768, pin=False, progress=False, meminfo=meminfo)


@pytest.mark.parametrize(
    "requested, dtype, want",
    [
        (None, "bfloat16", "packed"),
        ("auto", "float32", "plain"),
        ("plain", "bfloat16", "plain"),
        ("packed", "bfloat16", "packed"),
    ],
)
def test_the_bank_format_follows_the_flag_and_the_dtype(requested, dtype, want):
    assert H.bank_format(requested, dtype) == want


def test_packing_a_model_that_is_not_bf16_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--expert-bank-format"):
        H.bank_format("packed", "float16")


def _wide_expert(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An expert whose values span 2^-60..2^60: most fall outside a 15-binade window and escape."""
    g = torch.Generator().manual_seed(seed)

    def wide(*shape):
        return (
            torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-60, 60, shape, generator=g).float())
        ).bfloat16()

    return wide(16, 32), wide(16, 32), wide(32, 16)


def test_sealing_shares_the_loose_escape_lists_and_a_load_after_the_first_copy_is_refused():
    plain, packed = _pair()
    for banks in (plain, packed):
        banks.load_expert(0, 1, *_wide_expert(2))
    packed.seal()
    index, bits = packed._escapes[0][1]
    assert len(index) > 100  # the loose list is now a view of the layer's block, not a second copy
    assert index.untyped_storage().data_ptr() == packed.esc_index[0].untyped_storage().data_ptr()
    assert bits.untyped_storage().data_ptr() == packed.esc_bits[0].untyped_storage().data_ptr()
    for banks in (plain, packed):  # before any copy a reload is laid out again
        banks.load_expert(0, 3, *_wide_expert(4))
    s13, s2 = torch.zeros(2, 32, 32, dtype=torch.bfloat16), torch.zeros(2, 32, 16, dtype=torch.bfloat16)
    packed.copy_experts(0, [(1, 0), (3, 1)], s13, s2)
    _assert_slot(s13, s2, 0, plain, 0, 1)
    _assert_slot(s13, s2, 1, plain, 0, 3)
    with pytest.raises(RuntimeError, match="load every expert before copying"):
        packed.load_expert(0, 3, *_wide_expert(5))  # copies (and graphs) hold the escapes' addresses now
    w13, _ = packed.expert(0, 3)
    assert torch.equal(_bits(w13), _bits(plain.w13[0][3]))  # the refused load changed nothing


def test_escapes_beyond_the_plans_allowance_are_logged_and_checked_against_host_ram(tmp_path):
    from structlog.testing import capture_logs

    meminfo = Path(tmp_path) / "meminfo"
    meminfo.write_text("MemAvailable:    4194304 kB\n")  # 4 GiB: room for the banks and the reserve
    packed = PackedHostBanks.allocate(*SHAPE, pin=False, progress=False, meminfo=meminfo)
    packed.fill_dummy(seed=3, progress=False)
    with capture_logs() as logs:
        packed.seal()  # the dummy weights' escapes fit the allowance: nothing to say
    assert not [e for e in logs if e["event"] == "packed_banks_escapes_above_plan"]
    packed.load_expert(1, 0, *_wide_expert(6))
    with capture_logs() as logs:
        packed.seal()
    warned = [e for e in logs if e["event"] == "packed_banks_escapes_above_plan"]
    assert warned and warned[0]["escapes"] == packed.escape_count > warned[0]["planned"] == 30
    meminfo.write_text("MemAvailable:    0 kB\n")
    packed.load_expert(1, 1, *_wide_expert(7))
    with pytest.raises(HostMemoryError, match="escaped values"):
        packed.seal()


def test_a_dummy_layer_filled_in_parts_holds_the_whole_fills_bits(monkeypatch):
    from ferry.services.worker.offload.host_memory import host_banks

    monkeypatch.setattr(host_banks, "DUMMY_CHUNK", 1000)  # parts that start and end inside chunks
    whole, parts = (host_banks.DummyPattern(torch.bfloat16, 5, 0.02, 0.002) for _ in range(2))
    w13, w2 = torch.empty(5, 32, 32, dtype=torch.bfloat16), torch.empty(5, 32, 16, dtype=torch.bfloat16)
    for _ in range(2):  # two layers: the second starts where the first's chunks end
        whole.fill(w13, w2)
        layer = parts.next_layer(w13.numel(), w2.numel())
        p13, p2 = torch.empty_like(w13), torch.empty_like(w2)
        for first, last in ((0, 2), (2, 3), (3, 5)):
            layer.fill(p13[first:last], p2[first:last], first * 32 * 32, first * 32 * 16)
        assert torch.equal(_bits(p13), _bits(w13)) and torch.equal(_bits(p2), _bits(w2))


def test_an_expert_whose_packing_would_outgrow_its_device_budget_is_packed_on_the_cpu(monkeypatch):
    from ferry.services.worker.offload.host_memory import packed_banks

    _, packed = _pair()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert packed._packing_device().type == "cuda"
    monkeypatch.setattr(
        packed_banks, "PACK_TEMP_BYTES", packed_banks.PACK_BYTES_PER_VALUE * (packed.v13 + packed.v2) - 1
    )
    assert packed._packing_device().type == "cpu"
