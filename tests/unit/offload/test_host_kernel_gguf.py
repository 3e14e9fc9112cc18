"""The host C kernel on GGUF block banks (kernels/host_experts_c/gguf_blocks.h): every block type the GGUF expert
formats hold, on both instruction sets.

Three holds: the kernel's own decode (the code its rows multiply with, through HostKernel.decode_rows) gives the
twin's dequantization (kernels/gguf_blocks.py, itself held to the gguf package's) bit for bit; its sum over the
pairs equals the torch host path's and the reference twin's (float32 rtol 1e-5; bf16 as the other formats' tests
hold it) for 1 and 8 tokens; gguf-mixed reads each layer's families in their own types. The banks are the dummy
fill's valid blocks with every block's scales drawn apart (some fp16 scales subnormal, some e8m0 bytes 0 and 1),
at shapes of an odd number of groups of 32 (the 32-value types) or of two blocks of 256, so a wrong group, block or
scale moves the values. A fault planted in a scratch build of the portable rows (a Q4_K scale's high bits from the
wrong byte, Q6_K's high bits shifted wrongly, Q8_0's codes a byte off) fails the bit-for-bit hold."""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

import pytest
import torch

from ferry.kernels.gguf_blocks import dequantize_rows
from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_rows_reference
from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats import worker_class
from ferry.services.worker.expert_formats.gguf_mixed import GgufMixedExperts
from ferry.services.worker.expert_formats.quantized import raw
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute.host_expert_kernel import HostKernel
from ferry.services.worker.offload.host_compute.host_experts import HostExperts
from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from tests.unit.offload.test_host_expert_epilogue import mismatch
from tests.unit.offload.test_host_expert_kernel import isas

pytestmark = pytest.mark.skipif(K.library()[0] is None, reason=f"host kernel not built: {K.library()[1]}")

LAYERS, EXPERTS, TOP_K = 2, 4, 2
TYPES = (
    "gguf-q8_0",
    "gguf-q4_0",
    "gguf-q4_1",
    "gguf-q5_0",
    "gguf-q5_1",
    "gguf-q4_k",
    "gguf-q5_k",
    "gguf-q6_k",
    "gguf-iq4_nl",
    "gguf-iq4_xs",
    "gguf-mxfp4",
)
# (hidden, inter): 7 and 3 groups of 32 a row; two blocks of 256 a w13 row and one a w2 row
SHAPES = {32: (224, 96), 256: (512, 256)}
MIXED_TYPES = (("Q4_K", "Q6_K"), ("Q8_0", "Q4_K"))  # per MoE layer: w13's type, w2's
SOURCES = pathlib.Path(__file__).resolve().parents[3] / "kernels" / "host_experts_c"


def draw_scales(worker, rows: torch.Tensor, layout, g: torch.Generator) -> None:
    """Every block's fp16 scale fields (gguf-mxfp4: its e8m0 byte) drawn apart, around weights of ~0.05: one block
    in 8 with an fp16 subnormal (or an e8m0 byte of 0 or 1), signs of either kind."""
    (q,) = (p for p in layout.parts if p.name == "q")
    blocks = raw(rows, q).view(rows.shape[0], -1, worker.plan.block_bytes)
    experts, n = blocks.shape[:2]
    rare = torch.rand(experts, n, generator=g) < 1 / 8
    if worker.plan.ggml_type == "MXFP4":
        centre = 127 + round(torch.log2(torch.tensor(0.05 / 2.93)).item())
        e = torch.randint(centre - 1, centre + 3, (experts, n), generator=g)
        blocks[:, :, 0] = torch.where(rare, torch.randint(0, 2, (experts, n), generator=g), e).to(torch.uint8)
        return
    for offset, unit in worker.scale_fields:
        value = 0.05 * unit * torch.exp2(torch.rand(experts, n, generator=g) * 2 - 1)
        value = value * torch.where(torch.rand(experts, n, generator=g) < 0.25, -1.0, 1.0)
        half = value.to(torch.float16).view(torch.int16)
        subnormal = torch.randint(1, 1024, (experts, n), generator=g, dtype=torch.int16)
        half = torch.where(rare, subnormal, half)
        blocks[:, :, offset : offset + 2] = half.view(torch.uint8).view(experts, n, 2)


def fill(fmt_worker, banks: HostBanks, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(banks.num_layers):
        fmt_worker.fill_dummy_layer(banks.w13[layer], banks.w2[layer], layer, seed)
        for rows, layout, worker in zip(
            (banks.w13[layer], banks.w2[layer]), fmt_worker.layer_layouts(layer), family_workers(fmt_worker, layer)
        ):
            draw_scales(worker, rows, layout, g)


def family_workers(fmt_worker, layer: int):
    """The one-type workers of a layer's w13 and w2 (gguf-mixed: the layer's types)."""
    if isinstance(fmt_worker, GgufMixedExperts):
        return fmt_worker.layers[layer]
    return fmt_worker, fmt_worker


def make_banks(fmt: str, seed: int = 0) -> HostBanks:
    if fmt == "gguf-mixed":
        worker = GgufMixedExperts(*SHAPES[256], MIXED_TYPES)
    else:
        cls = worker_class(F.get(fmt))
        worker = cls(*SHAPES[cls.plan.block])
    banks = HostBanks.allocate(
        LAYERS, EXPERTS, worker.hidden, worker.inter, torch.bfloat16, pin=False, progress=False, fmt=worker
    )
    fill(worker, banks, seed)
    return banks


@pytest.fixture(scope="module")
def banks_of():
    made: dict = {}
    return lambda fmt: made.setdefault(fmt, make_banks(fmt))


def twin_rows(banks, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's float32 w13 and w2 of one expert, each family in its own type."""
    views = banks.format.gemm_views(banks.w13[layer], banks.w2[layer], layer)
    return tuple(dequantize_rows(v.q[expert], v.ggml_type, torch.float32) for v in views)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g) + 0.1
    pairs = [(t, int(experts[t, k]), float(weights[t, k])) for t in range(tokens) for k in range(TOP_K)]
    return experts, weights, pairs


def twin(banks, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    w13, w2 = banks.format.gemm_views(banks.w13[layer], banks.w2[layer], layer)
    rows = torch.zeros(x.shape[0], TOP_K, banks.hidden_size, dtype=torch.float32)
    grouped_expert_rows_reference(x, experts, weights, w13, w2, rows)
    out = rows[:, 0].clone()
    for k in range(1, TOP_K):  # in k order, as the pairs are listed
        out += rows[:, k]
    return out


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fmt", (*TYPES, "gguf-mixed"))
def test_the_rows_decode_every_block_as_the_twin_bit_for_bit(banks_of, fmt, isa):
    banks = banks_of(fmt)
    kernel = HostKernel(banks, torch.float32, threads=1, isa=isa)
    try:
        assert kernel.format == K.GGUF
        for layer in range(LAYERS):
            for expert in (0, EXPERTS - 1):
                got, want = kernel.decode_rows(layer, expert), twin_rows(banks, layer, expert)
                assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1]), (layer, expert)
    finally:
        kernel.close()


def test_the_banks_hold_what_makes_a_wrong_decode_visible(banks_of):
    """Scales that differ block by block (a wrong block's scale moves the values) and subnormal fp16 scales."""
    banks = banks_of("gguf-q4_k")
    view, _ = banks.format.gemm_views(banks.w13[0], banks.w2[0])
    blocks = view.q[0].reshape(-1, 144)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float().flatten()
    assert d.unique().numel() > blocks.shape[0] // 2 and bool(((d != 0) & (d.abs() < 2**-14)).any())
    w13, _ = twin_rows(banks, 0, 0)
    assert w13.isfinite().all() and w13.abs().max() > 0


def bf16_tipped(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where bf16 compute's `got` is past float32's tolerance of `want` (a rounding tipped by a sum's order), or
    None where some value is past a bf16 rounding (test_host_expert_epilogue.py's tolerances)."""
    scale = want.abs().max().item()
    if not bool(torch.isclose(got, want, rtol=2e-2, atol=4e-3 * scale).all()):
        return None
    return ~torch.isclose(got, want, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fmt", (*TYPES, "gguf-mixed"))
def test_the_c_kernel_computes_as_the_torch_path_and_the_twin(banks_of, fmt, isa):
    """float32: every call within float32's tolerance. bf16: every value within a bf16 rounding, and nearly every
    one (98 %) of the calls together within float32's: one intermediate value whose bf16 rounding a float32 sum's
    order tips moves a tenth of a token's rounded outputs by a bf16 step, so a one-token call alone may fall short."""
    banks = banks_of(fmt)
    for dtype in (torch.float32, torch.bfloat16):
        tipped = []
        for tokens, threads in ((1, 1), (8, 3)):
            x = (torch.randn(tokens, banks.hidden_size, generator=torch.Generator().manual_seed(tokens)) * 4).to(dtype)
            for layer in range(LAYERS):
                experts, weights, pairs = routing(tokens, layer)
                c = HostExperts(banks, dtype, threads=threads, kernel="c", isa=isa)
                t = HostExperts(banks, dtype, threads=1, kernel="torch")
                try:
                    assert c.backend == "c" and c.c_kernel.isa == isa
                    got, want = c.compute(layer, x, pairs), t.compute(layer, x, pairs)
                finally:
                    c.close()
                    t.close()
                for reference in (want, twin(banks, layer, x, experts, weights)):
                    if dtype == torch.float32:
                        assert mismatch(got, reference, dtype) is None, (tokens, layer)
                    else:
                        tipped.append(bf16_tipped(got, reference))
                        assert tipped[-1] is not None, (tokens, layer)
        if tipped:
            assert torch.cat([t.flatten() for t in tipped]).float().mean() < 0.02


def test_gguf_mixed_families_take_their_layers_types(banks_of):
    """Each MoE layer's w13 and w2 families carry that layer's block types (the decode test then holds each to
    the twin in its type)."""
    banks = banks_of("gguf-mixed")
    kernel = HostKernel(banks, torch.float32, threads=1, isa="portable")
    try:
        types = [(K.GGML_TYPES[f13.ggml_type], K.GGML_TYPES[f2.ggml_type]) for f13, f2 in kernel.families]
        assert tuple(types) == MIXED_TYPES
    finally:
        kernel.close()


def test_a_family_of_an_unknown_type_or_of_partial_blocks_is_refused(banks_of):
    banks = banks_of("gguf-q4_k")
    c = HostExperts(banks, torch.float32, threads=1, kernel="c", isa="portable")
    x = torch.randn(1, banks.hidden_size)
    try:
        f13, f2 = c.c_kernel.families[0]
        for field, bad in (("ggml_type", len(K.GGML_TYPES)), ("ggml_type", -1), ("cols", 96)):
            good = getattr(f2, field)
            setattr(f2, field, bad)
            with pytest.raises(RuntimeError, match="an invalid job"):
                c.compute(0, x, [(0, 1, 1.0)])
            with pytest.raises(RuntimeError, match="refused"):
                c.c_kernel.decode_rows(0, 1)
            setattr(f2, field, good)
        assert c.compute(0, x, [(0, 1, 1.0)]).abs().sum() > 0
    finally:
        c.close()


# (file, the sound text, the planted fault)
FAULTS = {
    "Q4_K scale high bits from the mins' byte": (
        "gguf_blocks.h",
        "*sc = (s[4 + j] & 0x0F) | ((s[j - 4] >> 2) & 0x30);",
        "*sc = (s[4 + j] & 0x0F) | ((s[j] >> 2) & 0x30);",
    ),
    "Q6_K high bits shifted by t, not 2t": (
        "expert_rows_portable.c",
        "((qh[i] >> 2 * t) & 3) << 4",
        "((qh[i] >> t) & 3) << 4",
    ),
    "Q8_0 codes a byte early": (
        "expert_rows_portable.c",
        "w[i] = d * (float)(int8_t)b[2 + i];",
        "w[i] = d * (float)(int8_t)b[1 + i];",
    ),
}
FAULT_TYPES = {"Q4_K": "gguf-q4_k", "Q6_K": "gguf-q6_k", "Q8_0": "gguf-q8_0"}


def portable_rows_build(tmp_path: pathlib.Path, fault: str | None) -> ctypes.CDLL:
    """The portable rows alone, built from a scratch copy of the sources, with `fault` planted."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a scratch copy of the rows")
    src = tmp_path / ("faulty" if fault else "sound")
    shutil.copytree(SOURCES, src)
    if fault:
        name, sound, planted = FAULTS[fault]
        text = (src / name).read_text()
        assert text.count(sound) == 1, f"{name} no longer holds {sound!r}: plant the fault anew"
        (src / name).write_text(text.replace(sound, planted))
    out = src / "rows.so"
    flags = ["-O1", "-std=gnu11", "-ffp-contract=off", "-fPIC", "-shared"]
    subprocess.run([cc, *flags, "-o", str(out), str(src / "expert_rows_portable.c"), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    fn = lib.ferry_decode_rows_portable
    fn.argtypes = [ctypes.POINTER(K.Family), ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    fn.argtypes += [ctypes.c_void_p]
    lib.ferry_tables_init()
    return lib


def scratch_decode(lib: ctypes.CDLL, f: K.Family, expert: int) -> torch.Tensor:
    out = torch.empty(f.rows, f.cols, dtype=torch.float32)
    lib.ferry_decode_rows_portable(
        ctypes.byref(f), K.GGUF, f.base + expert * f.expert_stride, 0, f.rows, out.data_ptr()
    )
    return out


@pytest.mark.parametrize("fault", (None, *FAULTS))
def test_a_fault_planted_in_the_rows_decode_fails_the_hold(banks_of, tmp_path, fault):
    """The scratch build without a fault passes the hold the tree's kernel is held to; with one, it fails."""
    ggml_type = (fault or "Q4_K").split()[0]
    banks = banks_of(FAULT_TYPES[ggml_type])
    lib = portable_rows_build(tmp_path, fault)
    kernel = HostKernel(banks, torch.float32, threads=1, isa="portable")
    try:
        held = all(
            bits_equal(scratch_decode(lib, f, expert), want)
            for layer in range(LAYERS)
            for expert in (0, EXPERTS - 1)
            for f, want in zip(kernel.families[layer], twin_rows(banks, layer, expert))
        )
    finally:
        kernel.close()
    assert held == (fault is None)
