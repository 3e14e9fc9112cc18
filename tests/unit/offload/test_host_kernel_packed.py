"""The host C kernel on packed banks (12-bit bf16, kernels/expert_pack.py; kernels/host_experts_c/packed_rows.h).

Two holds, on both instruction sets and on shapes whose rows end in a partial vector or are shorter
than one: the kernel's own decode (the code its rows multiply with, through HostKernel.decode_packed)
gives unpack_expert_reference's bits for every value, escapes of every kind included (subnormals,
values below the window, the window's edge, ±0, ±inf, NaNs with payloads, adjacent escapes in one
vector, at a row's first and last value and at a family's edges); and its sum over the pairs equals
the torch packed path's (float32 rtol 1e-5; bf16 as the plain bf16 tests hold it) for 1 and 8 tokens,
on an expert whose outlier pushes a tenth of each family out of the window, so that a misplaced
escape, or a window one binade off, moves the output far past the tolerance."""

from __future__ import annotations

import pytest
import torch

from ferry.kernels.expert_pack import unpack_expert_reference
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute.host_experts import HostExperts
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks
from tests.unit.offload.test_host_expert_kernel import (
    _both,
    isas,
)  # the C and the torch path on one call; the ISAs here

pytestmark = pytest.mark.skipif(K.library()[0] is None, reason=f"host kernel not built: {K.library()[1]}")

EXPERTS = 4
COMPUTED_LAYERS = (0, 1)  # layer 2 holds the inf / NaN expert: decoded bit for bit, never summed
# (hidden, inter): vectors of 32 whole; rows ending 18 and 14 values into a vector; w2 rows of 18
# values, shorter than one vector
SHAPES = {"even": (256, 160), "odd": (210, 46), "narrow": (66, 18)}


def _bits(*values: int) -> torch.Tensor:
    return torch.tensor([v - 0x10000 if v > 0x7FFF else v for v in values], dtype=torch.int16).view(torch.bfloat16)


def _expert(g: torch.Generator, hidden: int, inter: int, kind: str):
    gate, up = (torch.randn(inter, hidden, generator=g) * hidden**-0.5 for _ in range(2))
    down = torch.randn(hidden, inter, generator=g) * 0.1 * inter**-0.5  # its own, lower exponent base
    gate, up, down = gate.bfloat16(), up.bfloat16(), down.bfloat16()
    if kind == "escapes":
        gate[0, :4] = torch.tensor([1e-40, -1e-40, -0.0, 0.0])  # subnormals at a row's start, then ±0
        gate[0, -2:] = torch.tensor([2.5e-38, -3e-30])  # normal but far below the window, the row's end
        gate[1, :3] = torch.tensor([1.0, 1.5 * 2.0**-15, -(2.0**-14)])  # top 2^0: base 2^-15 escapes, 2^-14 is code 1
        up[-1, -1] = 5e-39  # the last value of w13: the families' edge
        down[0, 0] = 1e-41  # the first value of w2
        down[3, 5:9] = torch.tensor([1e-39, -2e-38, 3e-36, -4e-40])  # adjacent escapes in one vector
        down[4] = torch.tensor([(-1.0) ** j * 0.0 for j in range(inter)])  # a row of signed zeros
        down[-1, -1] = -2e-40  # the expert's last value
    elif kind == "outlier":  # 2^8 above the rest: every value below 2^-7 escapes, a tenth of each family
        gate[0, 0] = 256.0
        down[2, 0] = 32.0
    elif kind == "inf-nan":
        gate[2, :5] = _bits(0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81)  # ±inf, NaN, -NaN with payload, signalling
        down[2, 3] = _bits(0xFFFF)[0]
    return gate, up, down


def make_packed(hidden: int, inter: int, seed: int = 0) -> PackedHostBanks:
    g = torch.Generator().manual_seed(seed)
    banks = PackedHostBanks.allocate(3, EXPERTS, hidden, inter, pin=False, progress=False)
    kinds = {(0, 1): "escapes", (1, 2): "outlier", (1, 3): "escapes", (2, 3): "inf-nan"}
    for layer in range(3):
        for e in range(EXPERTS):
            banks.load_expert(layer, e, *_expert(g, hidden, inter, kinds.get((layer, e), "plain")))
    banks.seal()
    return banks


@pytest.fixture(scope="module")
def banks_of():
    made: dict = {}
    return lambda shape: made.setdefault(shape, make_packed(*SHAPES[shape]))


def _reference(banks: PackedHostBanks, layer: int, expert: int) -> torch.Tensor:
    index, bits = banks.escapes(layer, expert)
    return unpack_expert_reference(
        banks.lo[layer][expert], banks.hi[layer][expert], banks.base[layer][expert], index, bits, banks.v13
    )


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernels_decode_is_the_references_bit_for_bit(banks_of, shape, isa):
    banks = banks_of(shape)
    assert banks.escape_count > 40
    host = HostExperts(banks, torch.bfloat16, threads=1, kernel="c", isa=isa)
    try:
        for layer in range(3):
            for e in range(EXPERTS):
                got, want = host.c_kernel.decode_packed(layer, e), _reference(banks, layer, e)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (layer, e)
    finally:
        host.close()
    nan = _reference(banks, 2, 3)[: banks.v13].view(2 * banks.intermediate_size, -1)[2, :5].view(torch.int16)
    assert nan.tolist() == _bits(0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81).view(torch.int16).tolist()


@pytest.mark.parametrize("isa", isas())
def test_a_zeros_stray_mantissa_bits_are_dropped_as_the_reference_drops_them(isa):
    """The packer writes a zero's lo as its sign alone, but the reference decodes any code-0 value not
    listed as an escape to the signed zero whatever its lo holds; so does the kernel."""
    banks = make_packed(*SHAPES["narrow"], seed=2)
    assert banks.lo[0][1][2:4].tolist() == [0x80, 0x00] and banks.hi[0][1][1] == 0  # expert 1's -0.0, 0.0
    banks.lo[0][1][2:4] = torch.tensor([0xC3, 0x7F], dtype=torch.uint8)
    host = HostExperts(banks, torch.bfloat16, threads=1, kernel="c", isa=isa)
    try:
        got, want = host.c_kernel.decode_packed(0, 1), _reference(banks, 0, 1)
    finally:
        host.close()
    assert want.view(torch.int16)[2:4].tolist() == [-0x8000, 0]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def _pairs(tokens: int, seed: int) -> list:
    """3 experts a token (the escape and outlier experts among them), one pair repeated."""
    g = torch.Generator().manual_seed(seed)
    pairs = [
        (t, int(e), float(w))
        for t in range(tokens)
        for e, w in zip(torch.randperm(EXPERTS, generator=g)[:3], torch.rand(3, generator=g) + 0.1)
    ]
    return pairs + [(0, 2, 0.25), (tokens - 1, 1, -0.5), (0, 3, 0.125)]


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_compute_equals_the_torch_packed_path(banks_of, shape, tokens, isa):
    banks = banks_of(shape)
    x = torch.randn(tokens, banks.hidden_size, generator=torch.Generator().manual_seed(tokens))
    for layer, threads in zip(COMPUTED_LAYERS, (1, 3)):
        got, want = _both(banks, torch.float32, x, _pairs(tokens, layer), layer, isa, threads)
        assert got.shape == (tokens, banks.hidden_size) and torch.isfinite(want).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_compute_rounds_where_the_torch_packed_path_rounds(banks_of, shape, tokens, isa):
    """As test_host_expert_kernel.py holds plain bf16: equal within float32's tolerance nearly everywhere,
    within a bf16 rounding everywhere (a float32 sum's order may tip a rounding)."""
    banks = banks_of(shape)
    x = torch.randn(tokens, banks.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
    for layer, threads in zip(COMPUTED_LAYERS, (1, 3)):
        got, want = _both(banks, torch.bfloat16, x, _pairs(tokens, 7 + layer), layer, isa, threads)
        scale = want.abs().max().item()
        assert torch.isclose(got, want, rtol=1e-5, atol=1e-6 * scale).float().mean() > 0.98
        torch.testing.assert_close(got, want, rtol=2e-2, atol=4e-3 * scale)


def test_auto_takes_the_c_kernel_and_follows_a_later_load(banks_of):
    """A load after the kernel was made unseals the banks; the next call seals them and reads the new escapes."""
    banks = make_packed(*SHAPES["odd"], seed=4)
    host = HostExperts(banks, torch.float32, threads=2)
    twin = HostExperts(banks, torch.float32, threads=1, kernel="torch")
    x = torch.randn(2, banks.hidden_size, generator=torch.Generator().manual_seed(9))
    pairs = [(0, 0, 0.5), (1, 0, 1.0), (1, 1, 0.25)]
    try:
        assert host.backend == "c"
        before = host.compute(0, x, pairs)
        banks.load_expert(0, 0, *_expert(torch.Generator().manual_seed(11), *SHAPES["odd"], "outlier"))
        after, want = host.compute(0, x, pairs), twin.compute(0, x, pairs)
        assert not torch.allclose(before, after)
        torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    finally:
        host.close()
        twin.close()
