"""Routed experts computed on the host (services/worker/offload/host_compute/host_experts.py) against the
reference twin.

These test HostExperts' torch backend (kernel="torch"), itself the C kernel's twin
(test_host_expert_kernel.py).

For every bank format (plain, packed, nvfp4, mxfp4, fp8-block) the host's sum over (token, expert, weight)
pairs equals kernels/grouped_expert_gemm_reference.py's over the same bank (quantized banks through
its dequantizing twin, packed ones through unpack_expert_reference) in float32, and each decoded
expert is the reference's dequantization bit for bit, across decode chunk edges. Mistakes a decoder
could make (nibble order, a scale, the packed layout) are shown to break that equality."""

from __future__ import annotations

import math

import pytest
import torch

from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_rows_reference
from ferry.kernels.quantized_experts import dequantize_slot
from ferry.services.worker.expert_formats import mxfp4 as MX
from ferry.services.worker.expert_formats.fp8_block import Fp8BlockExperts
from ferry.services.worker.expert_formats.nvfp4 import Nvfp4Experts
from ferry.services.worker.offload.host_compute import host_expert_weights as W
from ferry.services.worker.offload.host_compute.host_experts import HostExperts
from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks

# 2 MoE layers of 4 experts; I = 160 gives fp8 blocks cut at both edges (rows 128 + 32 a projection, w2's
# columns 128 + 32), and a decode chunk of 1000 values cuts rows and families unevenly.
LAYERS, EXPERTS, HIDDEN, INTER = 2, 4, 256, 160
FORMATS = ("plain", "packed", "nvfp4", "mxfp4", "fp8-block")
LAYOUTS = {"nvfp4": Nvfp4Experts, "mxfp4": MX.Mxfp4Experts, "fp8-block": Fp8BlockExperts}
SMALL_CHUNK = 1000
PAIRS = [(0, 1, 0.25), (1, 3, 0.5), (2, 0, 1.0), (0, 2, 0.75), (2, 3, -0.5), (1, 1, 0.125)]


def _bf16_expert(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gate, up = (torch.randn(INTER, HIDDEN, generator=g) * HIDDEN**-0.5 for _ in range(2))
    # down about three binades below gate/up, as trained models' are: the two families' exponent bases differ
    return gate.bfloat16(), up.bfloat16(), (torch.randn(HIDDEN, INTER, generator=g) * 0.1 * INTER**-0.5).bfloat16()


def _randomize_quantized(banks: HostBanks, g: torch.Generator) -> None:
    """Random valid codes and random scales in every part (the dummy fill's scales are constant, and a
    decoder that misplaced them would pass on it). fp8 codes include zeros and subnormals; mxfp4 scales the
    e8m0 byte 0 (2^-127, a float32 subnormal) once a row."""
    for layer in range(LAYERS):
        for f in banks.format.gemm_views(banks.w13[layer], banks.w2[layer]):
            if f.fmt == "mxfp4":  # e8m0 bytes 2^-2 .. 2^1 around weights of rms 0.05 / sqrt(cols)
                f.q.copy_(torch.randint(0, 256, f.q.shape, generator=g, dtype=torch.uint8))
                centre = 127 + round(math.log2(0.05 * f.cols**-0.5 / 2.93))
                f.scale.copy_(torch.randint(centre - 2, centre + 2, f.scale.shape, generator=g, dtype=torch.int32))
                f.scale[:, :, 2] = 0
            elif f.fmt == "nvfp4":
                f.q.copy_(torch.randint(0, 256, f.q.shape, generator=g, dtype=torch.uint8))  # any byte is two codes
                f.scale.copy_(torch.exp2(torch.rand(f.scale.shape, generator=g) * 4 - 3).to(torch.float8_e4m3fn))
                f.gscale.copy_(0.05 * f.cols**-0.5 * torch.exp2(torch.rand(f.gscale.shape, generator=g)))
            else:
                f.q.copy_(torch.randn(f.q.shape, generator=g).to(torch.float8_e4m3fn))
                f.q.view(torch.uint8)[:, :, :8] = torch.tensor([0, 1, 2, 7, 0x80, 0x81, 0x86, 0x87], dtype=torch.uint8)
                f.scale.copy_(torch.exp2(torch.rand(f.scale.shape, generator=g) * 2 - 1) * 0.7 * f.cols**-0.5)


def make_banks(fmt: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if fmt == "plain":
        banks = HostBanks.allocate(LAYERS, EXPERTS, HIDDEN, INTER, torch.float32, pin=False, progress=False)
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                banks.load_expert(layer, e, *(t.float() for t in _bf16_expert(g)))
        return banks
    if fmt == "packed":
        banks = PackedHostBanks.allocate(LAYERS, EXPERTS, HIDDEN, INTER, pin=False, progress=False)
        for layer in range(LAYERS):
            for e in range(EXPERTS):
                gate, up, down = _bf16_expert(g)
                if (layer, e) == (1, 2):  # escapes: a subnormal, a value far below the window, and zeros
                    gate[0, :4] = torch.tensor([1e-40, -3e-30, 0.0, -0.0])
                    down[5, 7] = 2e-35
                banks.load_expert(layer, e, gate, up, down)
        banks.seal()
        assert banks.escape_count >= 2
        return banks
    layout = LAYOUTS[fmt](HIDDEN, INTER)
    banks = HostBanks.allocate(LAYERS, EXPERTS, HIDDEN, INTER, torch.bfloat16, pin=False, progress=False, fmt=layout)
    _randomize_quantized(banks, g)
    return banks


def reference_weights(banks, layer: int, dtype: torch.dtype):
    """The layer's experts as the reference twin takes them: dense [E, 2I, H] / [E, H, I], or the
    quantized families themselves (it dequantizes them to x's dtype)."""
    if isinstance(banks, PackedHostBanks):
        experts = [banks.expert(layer, e) for e in range(EXPERTS)]
        return torch.stack([w13 for w13, _ in experts]).to(dtype), torch.stack([w2 for _, w2 in experts]).to(dtype)
    if banks.format.quantized:
        return banks.format.gemm_views(banks.w13[layer], banks.w2[layer])
    return banks.w13[layer].to(dtype), banks.w2[layer].to(dtype)


def reference_sum(banks, layer: int, x: torch.Tensor, pairs) -> torch.Tensor:
    """The reference grouped GEMM's rows for the pairs (pair p in column p of its token), summed in order."""
    slots = torch.full((x.shape[0], max(1, len(pairs))), -1, dtype=torch.int64)
    weights = torch.zeros(slots.shape)
    for p, (token, expert, weight) in enumerate(pairs):
        slots[token, p], weights[token, p] = expert, weight
    rows = torch.zeros(*slots.shape, x.shape[1])
    grouped_expert_rows_reference(x, slots, weights, *reference_weights(banks, layer, x.dtype), rows)
    return rows.sum(dim=1)


def reference_expert(banks, layer: int, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w13, w2 = reference_weights(banks, layer, dtype)
    if isinstance(w13, torch.Tensor):
        return w13[expert], w2[expert]
    return dequantize_slot(w13, expert, dtype), dequantize_slot(w2, expert, dtype)


def _x(tokens: int = 3, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype)


def _computes_the_reference(banks, chunk: int = W.DECODE_CHUNK) -> bool:
    host = HostExperts(banks, torch.float32, threads=1, decode_chunk=chunk, kernel="torch")
    try:
        x = _x()
        sums = [(host.compute(layer, x, PAIRS), reference_sum(banks, layer, x, PAIRS)) for layer in range(LAYERS)]
        return all(torch.allclose(got, want, rtol=1e-5, atol=1e-6) for got, want in sums)
    finally:
        host.close()


def _decodes_the_reference(banks, dtype: torch.dtype, chunk: int) -> bool:
    reader = W.expert_reader(banks, dtype, chunk)
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            for got, want in zip(reader.expert(layer, e), reference_expert(banks, layer, e, dtype)):
                same_bits = torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))
                if got.shape != want.shape or not same_bits:
                    return False
    return True


@pytest.fixture(scope="module")
def banks_of():
    made: dict[str, object] = {}
    return lambda fmt: made.setdefault(fmt, make_banks(fmt))


@pytest.mark.parametrize("chunk", [W.DECODE_CHUNK, SMALL_CHUNK])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_host_sum_over_pairs_is_the_reference_grouped_gemm_in_float32(banks_of, fmt, chunk):
    assert _computes_the_reference(banks_of(fmt), chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_decoded_expert_is_the_references_dequantization_bit_for_bit(banks_of, fmt, dtype):
    if fmt == "plain" and dtype == torch.float32:  # read in place: the bank's own rows
        w13, _ = W.expert_reader(banks_of(fmt), dtype).expert(1, 2)
        assert w13.data_ptr() == banks_of(fmt).w13[1][2].data_ptr()
    assert _decodes_the_reference(banks_of(fmt), dtype, SMALL_CHUNK)


@pytest.mark.parametrize("fmt", ["packed", "nvfp4", "mxfp4", "fp8-block"])
def test_bf16_activations_compute_within_bf16_rounding_of_the_reference(banks_of, fmt):
    banks, x = banks_of(fmt), _x(dtype=torch.bfloat16)
    host = HostExperts(banks, torch.bfloat16, threads=1, kernel="torch")
    got, want = host.compute(1, x, PAIRS), reference_sum(banks, 1, x, PAIRS)
    host.close()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


def test_packed_escapes_inf_and_nan_decode_as_the_reference():
    banks = make_banks("packed")
    gate, up, down = _bf16_expert(torch.Generator().manual_seed(3))
    gate[1, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    banks.load_expert(0, 3, gate, up, down)
    banks.seal()
    assert _decodes_the_reference(banks, torch.bfloat16, SMALL_CHUNK)


def _swap_nibbles(t: torch.Tensor) -> None:
    t.copy_((t << 4) | (t >> 4))


@pytest.mark.parametrize(
    "mistake",
    [
        "nvfp4 nibble order",
        "nvfp4 group scale",
        "nvfp4 row scale",
        "mxfp4 nibble order",
        "mxfp4 scale bias 126",
        "fp8 block scale",
        "packed nibble order",
        "packed family bases",
    ],
)
def test_a_mistaken_layout_breaks_the_equality(mistake):
    """Each mistake is made in the bank's bytes (what the host would read if it decoded them wrongly):
    the host computes the mistaken bank, the reference the right one, and they must differ."""
    fmt = {"nvfp4": "nvfp4", "mxfp4": "mxfp4", "fp8": "fp8-block", "packed": "packed"}[mistake.split()[0]]
    right, wrong = make_banks(fmt), make_banks(fmt)
    for layer in range(LAYERS):
        if fmt == "packed":
            if mistake == "packed nibble order":
                _swap_nibbles(wrong.hi[layer])
            else:
                wrong.base[layer].copy_(wrong.base[layer].flip(-1))
            continue
        f13, f2 = wrong.format.gemm_views(wrong.w13[layer], wrong.w2[layer])
        if mistake in ("nvfp4 nibble order", "mxfp4 nibble order"):
            _swap_nibbles(f13.q)
        elif mistake == "mxfp4 scale bias 126":  # e8m0 read as 2^(s - 126): every scale doubled
            f13.scale.add_(1)
        elif mistake == "nvfp4 group scale":  # scales read one group late
            f13.scale.copy_(f13.scale.view(torch.uint8).roll(1, dims=-1).view(torch.float8_e4m3fn))
        elif mistake == "nvfp4 row scale":  # gate's and up's per-tensor scales swapped
            f13.gscale.copy_(f13.gscale.roll(INTER, dims=-1))
        else:  # block scales read transposed within the first projection's blocks
            f13.scale.copy_(f13.scale.roll(1, dims=-1))
    x = _x()
    host = HostExperts(wrong, torch.float32, threads=1, kernel="torch")
    got = host.compute(0, x, PAIRS)
    host.close()
    assert not torch.allclose(got, reference_sum(right, 0, x, PAIRS), rtol=1e-3, atol=1e-4)
    assert _computes_the_reference(wrong)  # the host is right about the bank it was given


@pytest.mark.parametrize(
    "mistake", ["nibble lanes swapped", "e4m3 factor", "packed sign mask", "e8m0 bias 126", "e8m0 byte 0 as zero"]
)
def test_a_mistaken_decoder_fails_the_bit_for_bit_check(monkeypatch, banks_of, mistake):
    """The same check catches a decoder's own mistakes, made here by patching its constants."""
    if mistake == "nibble lanes swapped":  # the high nibble read as element 2j
        right_order = W.nibble_codes

        def swapped(packed, words):
            codes = right_order(packed, words)
            return codes.copy_(codes.unflatten(-1, (-1, 2)).flip(-1).flatten(-2))

        monkeypatch.setattr(W, "nibble_codes", swapped)
        fmts = ("nvfp4", "packed")
    elif mistake == "e4m3 factor":
        monkeypatch.setattr(W, "E4M3_IN_FP16", 2.0**7)
        fmts = ("nvfp4", "fp8-block")
    elif mistake == "e8m0 bias 126":  # the exponent field one binade high
        right_bits = MX.e8m0_as_float32
        monkeypatch.setattr(MX, "e8m0_as_float32", lambda s, out: right_bits(s, out).mul_(2.0))
        fmts = ("mxfp4",)
    elif mistake == "e8m0 byte 0 as zero":  # the subnormal 2^-127 dropped (exact where the reference is)
        right_bits = MX.e8m0_as_float32
        monkeypatch.setattr(MX, "e8m0_as_float32", lambda s, out: right_bits(s, out).masked_fill_(s == 0, 0.0))
        fmts = ("mxfp4",)
    else:
        monkeypatch.setattr(W, "SIGN_AND_MANTISSA", 0x007F)
        fmts = ("packed",)
    for fmt in fmts:
        assert not _decodes_the_reference(banks_of(fmt), torch.float32, SMALL_CHUNK), fmt


def test_no_pairs_give_zeros_and_a_repeated_token_sums_its_pairs(banks_of):
    banks = banks_of("nvfp4")
    host = HostExperts(banks, torch.float32, threads=1, kernel="torch")
    x = _x(4)
    empty = host.compute(0, x, [])
    assert empty.dtype == torch.float32 and empty.shape == (4, HIDDEN) and not empty.any()
    # token 2 four times, expert 1 twice for it
    repeated = [(2, 1, 0.5), (2, 3, 0.25), (0, 1, 1.0), (2, 1, 0.125), (2, 0, -1.0)]
    got = host.compute(0, x, repeated)
    torch.testing.assert_close(got, reference_sum(banks, 0, x, repeated), rtol=1e-5, atol=1e-6)
    one_at_a_time = sum(host.compute(0, x, [pair]) for pair in repeated)
    torch.testing.assert_close(got, one_at_a_time, rtol=1e-5, atol=1e-6)
    assert not got[1].any() and not got[3].any() and got[2].abs().sum() > 0
    host.close()


def test_threads_are_set_on_the_dedicated_thread_only(banks_of):
    before = torch.get_num_threads()
    host = HostExperts(banks_of("plain"), torch.float32, threads=before + 1, kernel="torch")
    assert host._pool.submit(torch.get_num_threads).result() == before + 1
    assert torch.get_num_threads() == before
    host.close()
    with pytest.raises(ValueError, match="at least one thread"):
        HostExperts(banks_of("plain"), torch.float32, threads=0, kernel="torch")


@pytest.mark.parametrize("kernel", ["torch", "c"])
def test_bad_calls_are_refused_before_any_work(banks_of, kernel):
    """On either backend: the C kernel reads the banks by these indices, unchecked, so a bad one must
    never reach it (an expert past the banks read memory past them)."""
    from ferry.services.worker.offload.host_compute import host_expert_kernel as K

    if kernel == "c" and K.library()[0] is None:
        pytest.skip(f"host kernel not built: {K.library()[1]}")
    host = HostExperts(banks_of("fp8-block"), torch.float32, threads=1, kernel=kernel)
    x = _x()
    for layer, xs, pairs, match in (
        (0, x, [(3, 0, 1.0)], "outside 3 tokens"),
        (0, x, [(0, EXPERTS, 1.0)], "expert 4"),
        (0, x, [(0, 10**7, 1.0)], "expert 10000000"),
        (0, x, [(-1, 0, 1.0)], "token -1"),
        (LAYERS, x, [], "MoE layer 2"),
        (-1, x, [], "MoE layer -1"),
        (0, x.bfloat16(), [], "float32"),
        (0, x[:, :-1], [], "float32"),
    ):
        with pytest.raises(ValueError, match=match):
            host.compute(layer, xs, pairs)
    host.close()
