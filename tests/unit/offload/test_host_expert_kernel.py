"""The host's C expert kernel (HostExperts' `c` backend: services/worker/offload/host_compute/host_expert_kernel.py,
kernels/host_experts_c/) against its twin, HostExperts' torch backend, itself tested against the
reference grouped GEMM (test_host_experts.py).

For every format the kernel has (plain bf16 and float32 banks, fp8-block, nvfp4, mxfp4), both instruction
sets (the AVX-512 BF16 rows where the CPU has them, the portable rows always), float32 and bf16
compute, 1 and 8 tokens, 1 and 3 threads, shapes whose H and I are no multiple of the vector width
(and fp8 blocks cut at every edge), pairs with repeated experts, a token listed twice for the same
expert and tokens with no pair: the C kernel's sum equals the torch path's within float32's
tolerance (packed banks: test_host_kernel_packed.py). With no library (or banks it cannot compute:
float16, packed banks of odd shapes) HostExperts keeps the torch path and logs why once."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from structlog.testing import capture_logs

from ferry.kernels.quantized_experts import dequantize_slot
from ferry.plan.expert_backend import pool_thread_cpus
from ferry.services.worker.expert_formats.fp8_block import Fp8BlockExperts
from ferry.services.worker.expert_formats.mxfp4 import Mxfp4Experts
from ferry.services.worker.expert_formats.nvfp4 import Nvfp4Experts
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute import host_experts as HE
from ferry.services.worker.offload.host_compute.host_expert_kernel import HostKernel
from ferry.services.worker.offload.host_compute.host_experts import HostExperts
from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks

LAYERS, EXPERTS = 2, 6
FORMATS = ("bf16", "float32", "fp8-block", "nvfp4", "mxfp4")
# (hidden, inter): the test suite's shapes (fp8 blocks of 128 + 32 columns); then odd ones: H and I
# short of a vector of 32 by 24 (fp8: partial row and column blocks, one row block below 128 rows)
# or by 16 for nvfp4, whose inputs come in groups of 16 (a vector's second group past the row's end); mxfp4's
# groups of 32 are whole vectors: odd numbers of them (the bf16 rows' last vector alone)
SHAPES = {"even": (256, 160), "odd": (200, 72), "odd-nvfp4": (208, 80), "odd-mxfp4": (224, 96)}
LAYOUTS = {"nvfp4": Nvfp4Experts, "mxfp4": Mxfp4Experts, "fp8-block": Fp8BlockExperts}

needs_library = pytest.mark.skipif(K.library()[0] is None, reason=f"host kernel not built: {K.library()[1]}")


def isas() -> list:
    lib = K.library()[0]
    avx = lib is not None and lib.ferry_host_isa_available(K.ISAS["avx512"])
    return ["portable", pytest.param("avx512", marks=pytest.mark.skipif(not avx, reason="no AVX-512 BF16 here"))]


def make_banks(fmt: str, hidden: int, inter: int, seed: int = 0) -> HostBanks:
    """Random weights in `fmt`: fp8 codes with zeros and subnormals, random scales in every part."""
    g = torch.Generator().manual_seed(seed)
    if fmt in ("bf16", "float32"):
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        banks = HostBanks.allocate(LAYERS, EXPERTS, hidden, inter, dtype, pin=False, progress=False)
        for layer in range(LAYERS):
            banks.w13[layer].copy_(torch.randn(banks.w13[layer].shape, generator=g) * hidden**-0.5)
            banks.w2[layer].copy_(torch.randn(banks.w2[layer].shape, generator=g) * inter**-0.5)
        return banks
    layout = LAYOUTS[fmt](hidden, inter)
    banks = HostBanks.allocate(LAYERS, EXPERTS, hidden, inter, torch.bfloat16, pin=False, progress=False, fmt=layout)
    for layer in range(LAYERS):
        for f in banks.format.gemm_views(banks.w13[layer], banks.w2[layer]):
            if fmt == "mxfp4":  # e8m0 scales 2^-1 .. 2^2 around weights of rms 0.2 / sqrt(cols); byte 0 once a row
                f.q.copy_(torch.randint(0, 256, f.q.shape, generator=g, dtype=torch.uint8))
                centre = 127 + round(math.log2(0.2 * f.cols**-0.5 / 2.93))
                f.scale.copy_(torch.randint(centre - 1, centre + 3, f.scale.shape, generator=g, dtype=torch.int32))
                f.scale[:, :, 1] = 0
            elif fmt == "nvfp4":
                f.q.copy_(torch.randint(0, 256, f.q.shape, generator=g, dtype=torch.uint8))
                f.scale.copy_(torch.exp2(torch.rand(f.scale.shape, generator=g) * 4 - 3).to(torch.float8_e4m3fn))
                f.gscale.copy_(0.2 * f.cols**-0.5 * torch.exp2(torch.rand(f.gscale.shape, generator=g)))
            else:
                f.q.copy_(torch.randn(f.q.shape, generator=g).to(torch.float8_e4m3fn))
                f.q.view(torch.uint8)[:, :, :8] = torch.tensor([0, 1, 2, 7, 0x80, 0x81, 0x86, 0x87], dtype=torch.uint8)
                f.scale.copy_(torch.exp2(torch.rand(f.scale.shape, generator=g) * 2 - 1) * f.cols**-0.5)
    return banks


def pairs_for(tokens: int, seed: int) -> list:
    """Each token routed to 3 of the experts (experts shared between tokens), one (token, expert)
    listed twice, and the last token of several without any pair."""
    g = torch.Generator().manual_seed(seed)
    listed = tokens if tokens == 1 else tokens - 1
    pairs = [
        (t, int(e), float(w))
        for t in range(listed)
        for e, w in zip(torch.randperm(EXPERTS, generator=g)[:3], torch.rand(3, generator=g) + 0.1)
    ]
    return pairs + [(0, pairs[0][1], -0.375)]


@pytest.fixture(scope="module")
def banks_of():
    made: dict = {}
    return lambda fmt, shape: made.setdefault((fmt, shape), make_banks(fmt, *SHAPES[shape]))


def _both(banks, dtype, x, pairs, layer, isa, threads):
    c = HostExperts(banks, dtype, threads=threads, kernel="c", isa=isa)
    t = HostExperts(banks, dtype, threads=1, kernel="torch")
    try:
        assert c.backend == "c" and c.c_kernel.isa == isa
        return c.compute(layer, x, pairs), t.compute(layer, x, pairs)
    finally:
        c.close()
        t.close()


def _shapes(fmt: str) -> list[str]:
    return ["even", f"odd-{fmt}" if f"odd-{fmt}" in SHAPES else "odd"]


@needs_library
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("tokens", [1, 8, 21])  # 21: ~10 tokens an expert, past the 8 a pass of the rows holds
@pytest.mark.parametrize("fmt", FORMATS)
def test_float32_compute_equals_the_torch_path_within_float32_tolerance(banks_of, fmt, tokens, isa):
    for shape, threads in zip(_shapes(fmt), (1, 3)):
        banks = banks_of(fmt, shape)
        x = torch.randn(tokens, banks.hidden_size, generator=torch.Generator().manual_seed(tokens))
        for layer in range(LAYERS):
            got, want = _both(banks, torch.float32, x, pairs_for(tokens, layer), layer, isa, threads)
            assert got.dtype == torch.float32 and got.shape == (tokens, banks.hidden_size)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
            if tokens > 1:
                assert not got[-1].any()  # the token without pairs


@needs_library
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_compute_rounds_where_the_torch_path_rounds(banks_of, fmt, tokens, isa):
    """In bf16 the kernel rounds the linear outputs, SiLU and the product to bf16 where torch does, so
    the two differ only where a float32 sum's order tips a rounding: nearly every value is equal
    within float32's tolerance, and every one within a bf16 rounding."""
    for shape, threads in zip(_shapes(fmt), (1, 3)):
        banks = banks_of(fmt, shape)
        x = torch.randn(tokens, banks.hidden_size, generator=torch.Generator().manual_seed(5)).bfloat16()
        got, want = _both(banks, torch.bfloat16, x, pairs_for(tokens, 7), 1, isa, threads)
        scale = want.abs().max().item()
        close = torch.isclose(got, want, rtol=1e-5, atol=1e-6 * scale)
        assert close.float().mean() > 0.98
        torch.testing.assert_close(got, want, rtol=2e-2, atol=4e-3 * scale)


@needs_library
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fmt", tuple(LAYOUTS))
def test_the_rows_decode_the_quantized_formats_as_the_twin_bit_for_bit(banks_of, fmt, isa):
    """The rows' own decode (HostKernel.decode_rows: the code they multiply with in float32 compute) gives
    kernels/quantized_experts.py's dequantization bit for bit, at every shape (partial fp8 blocks, half vectors)."""
    for shape in _shapes(fmt):
        banks = banks_of(fmt, shape)
        kernel = HostKernel(banks, torch.float32, threads=1, isa=isa)
        try:
            for layer in range(LAYERS):
                views = banks.format.gemm_views(banks.w13[layer], banks.w2[layer])
                for expert in (0, EXPERTS - 1):
                    for got, view in zip(kernel.decode_rows(layer, expert), views):
                        want = dequantize_slot(view, expert, torch.float32)
                        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (shape, layer, expert)
        finally:
            kernel.close()


@needs_library
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_two_instruction_sets_agree(banks_of, fmt):
    lib = K.library()[0]
    if not lib.ferry_host_isa_available(K.ISAS["avx512"]):
        pytest.skip("no AVX-512 BF16 here")
    banks = banks_of(fmt, _shapes(fmt)[1])
    x = torch.randn(8, banks.hidden_size, generator=torch.Generator().manual_seed(3))
    pairs = pairs_for(8, 3)
    out = {}
    for isa in ("avx512", "portable"):
        host = HostExperts(banks, torch.float32, threads=2, kernel="c", isa=isa)
        out[isa] = host.compute(0, x, pairs)
        host.close()
    torch.testing.assert_close(
        out["avx512"], out["portable"], rtol=1e-5, atol=1e-6 * out["portable"].abs().max().item()
    )


@needs_library
@pytest.mark.parametrize("isa", isas())
def test_no_pairs_give_zeros_and_the_pairs_sum_in_order(banks_of, isa):
    banks = banks_of("fp8-block", "odd")
    host = HostExperts(banks, torch.float32, threads=2, kernel="c", isa=isa)
    x = torch.randn(4, banks.hidden_size, generator=torch.Generator().manual_seed(1))
    empty = host.compute(0, x, [])
    assert empty.dtype == torch.float32 and empty.shape == (4, banks.hidden_size) and not empty.any()
    repeated = [(2, 1, 0.5), (2, 3, 0.25), (0, 1, 1.0), (2, 1, 0.125), (2, 0, -1.0)]
    got = host.compute(0, x, repeated)
    one_at_a_time = sum(host.compute(0, x, [pair]) for pair in repeated)
    torch.testing.assert_close(got, one_at_a_time, rtol=1e-5, atol=1e-6)
    assert not got[1].any() and not got[3].any() and got[2].abs().sum() > 0
    host.close()


@needs_library
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fmt", ("bf16", "fp8-block", "nvfp4", "mxfp4"))
def test_the_threads_split_changes_no_bit(banks_of, fmt, isa):
    """The pool's threads claim the work item by item (thread_pool.c), whichever comes first: each
    output row's sums run in one order however the items fall, so 1, 2, 5 and 9 threads (more than
    this machine's cores: workers preempted, woken late, claiming nothing) give the same bits, over
    several hundred calls back to back of 0 to 21 tokens, some with no pair at all, where a worker
    still looking at an ended call must claim none of the next."""
    banks = banks_of(fmt, _shapes(fmt)[1])
    g = torch.Generator().manual_seed(11)
    calls = []
    for i in range(240):
        tokens = int(torch.randint(1, 22, (1,), generator=g))
        x = torch.randn(tokens, banks.hidden_size, generator=g).bfloat16()
        pairs = [] if i % 17 == 5 else pairs_for(tokens, i)
        calls.append((i % LAYERS, x, pairs))
    want = None
    for threads in (1, 2, 5, 9):
        host = HostExperts(banks, torch.bfloat16, threads=threads, kernel="c", isa=isa)
        try:
            got = [host.compute(layer, x, pairs).view(torch.int32) for layer, x, pairs in calls]
        finally:
            host.close()
        if want is None:
            want = got
            continue
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), (threads, i)


@needs_library
@pytest.mark.parametrize("hidden", [8, 40, 1000])
def test_every_output_row_is_computed_whatever_the_blocks(hidden):
    """Phase 1's blocks of output rows are cut from the hidden size and the threads (16 rows or a multiple, a
    last block short): at hidden sizes of one block, a few and many, with more threads than blocks,
    every row of every token is the torch path's."""
    banks = HostBanks.allocate(1, 3, hidden, 24, torch.float32, pin=False, progress=False)
    g = torch.Generator().manual_seed(hidden)
    banks.w13[0].copy_(torch.randn(banks.w13[0].shape, generator=g) * hidden**-0.5)
    banks.w2[0].copy_(torch.randn(banks.w2[0].shape, generator=g) * 24**-0.5)
    x = torch.randn(3, hidden, generator=g)
    pairs = [(0, 0, 0.5), (1, 2, 1.0), (2, 1, 0.25), (0, 1, -0.75)]
    want = HostExperts(banks, torch.float32, threads=1, kernel="torch").compute(0, x, pairs)
    for threads in (1, 4, 7):
        host = HostExperts(banks, torch.float32, threads=threads, kernel="c", isa="portable")
        got = host.compute(0, x, pairs)
        host.close()
        assert got.abs().min(dim=1).values.gt(0).all()  # no row left at the zeros it starts from
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@needs_library
def test_the_isa_comes_from_the_environment_and_a_bad_one_is_refused(banks_of, monkeypatch):
    monkeypatch.setenv(K.ISA_ENV, "portable")
    host = HostExperts(banks_of("bf16", "even"), torch.bfloat16, threads=1)
    assert host.backend == "c" and host.c_kernel.isa == "portable"
    host.close()
    monkeypatch.setenv(K.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="sse9"):
        HostExperts(banks_of("bf16", "even"), torch.bfloat16, threads=1)


@needs_library
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fmt", (*FORMATS, "packed"))
def test_prefetching_the_weights_ahead_changes_no_bit(banks_of, fmt, isa):
    """The rows' prefetch is a hint (at a vector's own line, a row ahead, and far past the bank's end,
    where nothing may fault): the sums are the same bits as without it, at 1, 8 and 21 tokens."""
    if fmt == "packed":
        from tests.unit.offload.test_host_kernel_packed import make_packed

        banks = make_packed(*SHAPES["even"])
    else:
        banks = banks_of(fmt, _shapes(fmt)[1])
    host = HostExperts(banks, torch.bfloat16, threads=2, kernel="c", isa=isa)
    try:
        for tokens in (1, 8, 21):
            x = torch.randn(tokens, banks.hidden_size, generator=torch.Generator().manual_seed(tokens)).bfloat16()
            pairs = [(t, e % banks.num_experts, w) for t, e, w in pairs_for(tokens, tokens)]
            host.c_kernel.set_prefetch(0)
            want = host.compute(1, x, pairs).view(torch.int32)  # bits: the packed banks hold inf and NaN
            for ahead in (64, 4096, 1 << 30):
                host.c_kernel.set_prefetch(ahead)
                assert torch.equal(host.compute(1, x, pairs).view(torch.int32), want), (tokens, ahead)
    finally:
        host.close()


@needs_library
def test_the_prefetch_distance_comes_from_the_environment_and_a_bad_one_is_refused(banks_of, monkeypatch):
    banks = banks_of("bf16", "even")
    host = HostExperts(banks, torch.bfloat16, threads=1, kernel="c")
    assert host.c_kernel.prefetch == K.DEFAULT_PREFETCH_BYTES
    host.close()
    monkeypatch.setenv(K.PREFETCH_ENV, "2048")
    host = HostExperts(banks, torch.bfloat16, threads=1, kernel="c")
    assert host.c_kernel.prefetch == 2048
    with pytest.raises(ValueError, match="0 or more"):
        host.c_kernel.set_prefetch(-64)
    host.close()
    for bad in ("4k", "-1"):
        monkeypatch.setenv(K.PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=K.PREFETCH_ENV):
            HostExperts(banks, torch.bfloat16, threads=1, kernel="c")


@pytest.fixture
def no_library(monkeypatch):
    """The library as if it had not been built: its module name points nowhere."""
    K.library.cache_clear()
    HE._torch_path_once.cache_clear()
    monkeypatch.setattr(K, "LIBRARY_MODULE", "ferry.kernels._no_such_host_kernel")
    yield
    K.library.cache_clear()


def test_without_the_library_auto_keeps_the_torch_path_and_says_so_once(banks_of, no_library):
    banks = banks_of("bf16", "even")
    x = torch.randn(2, banks.hidden_size).bfloat16()
    with capture_logs() as logs:
        hosts = [HostExperts(banks, torch.bfloat16, threads=1) for _ in range(2)]
    assert [h.backend for h in hosts] == ["torch", "torch"]
    lines = [e for e in logs if e["event"] == "host_experts_torch_path"]
    assert len(lines) == 1 and "not built" in lines[0]["reason"]
    assert hosts[0].compute(0, x, [(1, 2, 0.5)])[1].abs().sum() > 0
    for h in hosts:
        h.close()
    with pytest.raises(K.KernelUnavailable, match="not built"):
        HostExperts(banks, torch.bfloat16, threads=1, kernel="c")


def test_a_library_that_fails_to_load_keeps_the_torch_path(banks_of, monkeypatch, tmp_path):
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not an ELF file")
    K.library.cache_clear()
    monkeypatch.setattr(K, "library_path", lambda: str(broken))
    try:
        host = HostExperts(banks_of("bf16", "even"), torch.bfloat16, threads=1)
        assert host.backend == "torch"
        host.close()
        assert "failed to load" in K.library()[1]
    finally:
        K.library.cache_clear()


@needs_library
def test_banks_the_kernel_lacks_keep_the_torch_path():
    packed = PackedHostBanks.allocate(1, 2, 61, 4, pin=False, progress=False)  # odd H: rows start mid-byte
    packed.fill_dummy(progress=False)
    packed.seal()
    half = HostBanks.allocate(1, 2, 64, 32, torch.float16, pin=False, progress=False)
    HE._torch_path_once.cache_clear()
    for banks, dtype, why in ((packed, torch.bfloat16, "packed"), (half, torch.float16, "float16")):
        with capture_logs() as logs:
            host = HostExperts(banks, dtype, threads=1)
        assert host.backend == "torch"
        assert [e["reason"] for e in logs if e["event"] == "host_experts_torch_path"][0].count(why)
        host.close()
        with pytest.raises(K.KernelUnavailable, match=why):
            HostExperts(banks, dtype, threads=1, kernel="c")


def _thread_state(tid: int) -> str:
    """A thread of this process's scheduler state: R running, S asleep (/proc's stat, after the name)."""
    import pathlib

    return pathlib.Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _thread_cpus() -> dict[int, str]:
    """Each thread of this process: its Cpus_allowed_list."""
    import pathlib

    got = {}
    for task in pathlib.Path("/proc/self/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                got[int(task.name)] = line.split(":", 1)[1].strip()
    return got


@needs_library
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="the threads' CPUs are read from Linux's /proc")
def test_the_pools_started_threads_run_on_their_cpus_and_compute_the_same(banks_of):
    banks = banks_of("bf16", "even")
    allowed = sorted(os.sched_getaffinity(0))
    x = torch.randn(2, banks.hidden_size).to(torch.bfloat16)
    pairs = pairs_for(2, 3)
    before = set(_thread_cpus())
    unpinned = HostExperts(banks, torch.bfloat16, threads=3, kernel="c")
    want = unpinned.compute(1, x, pairs)
    unpinned.close()
    # 3 threads: the caller and 2 started workers, on the last allowed CPU (round robin over a list of one)
    host = HostExperts(banks, torch.bfloat16, threads=3, kernel="c", cpus=[allowed[-1]])
    assert host.c_kernel.pinned == 2 and host.c_kernel.cpus == [allowed[-1]]
    started = {tid: cpus for tid, cpus in _thread_cpus().items() if tid not in before}
    assert sorted(started.values()).count(str(allowed[-1])) >= 2, started
    assert torch.equal(host.compute(1, x, pairs), want)
    host.close()
    if len(allowed) > 1:  # the list's first CPU is the caller's: the one started worker takes the second
        before = set(_thread_cpus())
        host = HostExperts(banks, torch.bfloat16, threads=2, kernel="c", cpus=[allowed[0], allowed[-1]])
        started = [cpus for tid, cpus in _thread_cpus().items() if tid not in before]
        assert pool_thread_cpus(2, [allowed[0], allowed[-1]])[1] == [allowed[-1]]
        assert str(allowed[-1]) in started and str(allowed[0]) not in started, started
        assert torch.equal(host.compute(1, x, pairs), want)
        host.close()
    # a CPU the process may not run on: refused, the workers run unpinned and compute the same
    refused = HostExperts(banks, torch.bfloat16, threads=3, kernel="c", cpus=[max(allowed) + 4096])
    assert refused.c_kernel.pinned == 0 and torch.equal(refused.compute(1, x, pairs), want)
    refused.close()


@needs_library
def test_the_pools_spin_comes_from_the_environment_and_a_bad_one_is_refused(banks_of, monkeypatch):
    banks = banks_of("bf16", "even")
    x = torch.randn(2, banks.hidden_size).to(torch.bfloat16)
    pairs = pairs_for(2, 3)
    host = HostExperts(banks, torch.bfloat16, threads=3, kernel="c")
    assert host.c_kernel.spin_us == K.DEFAULT_SPIN_US
    want = host.compute(1, x, pairs)
    host.close()
    for spin in ("0", "2000"):  # never spinning, and spinning through a step: the same bits
        monkeypatch.setenv(K.SPIN_ENV, spin)
        host = HostExperts(banks, torch.bfloat16, threads=3, kernel="c")
        assert host.c_kernel.spin_us == int(spin)
        for _ in range(3):
            assert torch.equal(host.compute(1, x, pairs), want)
        host.close()
    if os.path.isdir("/proc/self/task"):  # the spin is what the idle workers do: asleep at once, or running on
        before = set(_thread_cpus())
        host = HostExperts(banks, torch.bfloat16, threads=3, kernel="c")
        workers = [tid for tid in _thread_cpus() if tid not in before]
        for spin_us, state in ((0, "S"), (10_000_000, "R")):
            host.c_kernel.set_spin(spin_us)
            host.compute(1, x, pairs)  # the workers' next idle wait takes the new spin
            host.compute(1, x, pairs)
            time.sleep(0.05)
            states = {_thread_state(tid) for tid in workers}
            assert states == {state}, (spin_us, states)
        host.c_kernel.set_spin(0)
        host.compute(1, x, pairs)  # asleep again before they are joined
        host.close()
    for bad in ("50us", "-5"):
        monkeypatch.setenv(K.SPIN_ENV, bad)
        with pytest.raises(ValueError, match=K.SPIN_ENV):
            HostExperts(banks, torch.bfloat16, threads=1, kernel="c")


def test_a_build_lacking_entry_points_is_named_not_half_bound():
    from types import SimpleNamespace

    class Entry:  # stands in for a ctypes function: takes its signature as attributes
        argtypes = restype = "unbound"

    older = SimpleNamespace(ferry_host_kernel_compute=Entry(), ferry_host_node=Entry())
    missing = K.bind(older)
    assert "ferry_host_kernel_set_spin" in missing and "ferry_poller_create" in missing
    assert "ferry_host_kernel_compute" not in missing and len(missing) == len(K.SIGNATURES) - 2
    assert older.ferry_host_node.argtypes == K.SIGNATURES["ferry_host_node"][0]
    if K.library()[0] is not None:  # this tree's build has every one
        assert K.bind(K.library()[0]) == []
