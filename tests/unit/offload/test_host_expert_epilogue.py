"""The host's expert kernels on gpt-oss's experts, with biases and the clamped SwiGLU (kernels/expert_epilogue.py):
the C kernel (both instruction sets) and the torch host path against the reference twin
(kernels/grouped_expert_gemm_reference.py), which reads the same bank rows as its slots.

For mxfp4, nvfp4, GGUF blocks (q8_0, and gpt-oss's GGUF mxfp4) and plain banks (bf16 and float32, the biases in rows
after the weights), in float32 and bf16 compute: both equal the twin within the tolerances test_host_expert_kernel.py
holds the C kernel to the torch path (bf16: nearly every value within float32's, every one within a bf16 rounding;
at these sizes they are equal bit for bit). The clamp's limit is small enough that most gate and up values are
clamped and the biases large enough to move every output, so a kernel that drops the biases or skips the clamp
(planted below through the kernel's own job fields and the torch path's reader) is caught.

Gemma's experts (gelu_tanh(gate) * up, no biases; plain banks and bf16's packed ones): the C kernel equals the
torch path over plain banks of the same values, a kernel computing SiLU or a reference computing gelu's erf form
is caught, and an activation the kernel lacks is refused by name rather than computed as another."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
import torch.nn.functional as F

from ferry.kernels.expert_epilogue import GELU_TANH_AND_MUL, GELU_TANH_CODE, SILU_CODE, ExpertActivation
from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_rows_reference
from ferry.kernels.quantized_experts import dequantize_slot
from ferry.services.worker.expert_formats.bf16 import Bf16Experts
from ferry.services.worker.expert_formats.gguf_mxfp4 import GgufMxfp4Experts
from ferry.services.worker.expert_formats.gguf_q8_0 import GgufQ8_0Experts
from ferry.services.worker.expert_formats.mxfp4 import Mxfp4Experts
from ferry.services.worker.expert_formats.nvfp4 import Nvfp4Experts
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute.decode_share import HostDecodeShare
from ferry.services.worker.offload.host_compute.host_expert_kernel import HostKernel
from ferry.services.worker.offload.host_compute.host_experts import HostExperts
from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks
from tests.unit.offload.test_host_expert_kernel import isas, needs_library

LAYERS, EXPERTS, TOP_K = 2, 6, 3
HIDDEN, INTER = 224, 96  # odd numbers of 32-wide vectors (every format's groups), I < H: w2 keeps 3 bias rows
# gpt-oss's alpha, and a limit below the gate and up values' spread (x is scaled so they reach ~1), so most clamp
ACTIVATION = ExpertActivation(swiglu_limit=0.5, swiglu_alpha=1.702)
BIAS_STD = 0.3
FORMATS = ("mxfp4", "nvfp4", "bf16", "float32", "gguf-q8_0", "gguf-mxfp4")
FAULTS = ("bias dropped", "clamp missing")
QUANTIZED = {"mxfp4": Mxfp4Experts, "nvfp4": Nvfp4Experts, "gguf-q8_0": GgufQ8_0Experts, "gguf-mxfp4": GgufMxfp4Experts}


def make_banks(fmt: str, seed: int = 0) -> HostBanks:
    """Random weights and biases in `fmt`'s banks (quantized: the scales test_host_expert_kernel.py draws)."""
    g = torch.Generator().manual_seed(seed)
    if fmt in ("bf16", "float32"):
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        bias_rows = (-(-2 * INTER // HIDDEN), -(-HIDDEN // INTER))  # registry.bias_rows
        layout = Bf16Experts(HIDDEN, INTER, dtype, bias_rows, ACTIVATION)
        banks = HostBanks.allocate(LAYERS, EXPERTS, HIDDEN, INTER, dtype, pin=False, progress=False, fmt=layout)
        for layer in range(LAYERS):
            # w13 [E, 2I + b13, H], w2 [E, H + b2, I]: the weight rows, then the biases flat from the next row
            for rows, weight_rows, cols in ((banks.w13[layer], 2 * INTER, HIDDEN), (banks.w2[layer], HIDDEN, INTER)):
                rows.copy_(torch.randn(rows.shape, generator=g) * 0.2 * cols**-0.5)
                flat = rows[:, weight_rows:].reshape(EXPERTS, -1)
                flat.zero_()
                flat[:, :weight_rows] = torch.randn(EXPERTS, weight_rows, generator=g) * BIAS_STD
        return banks
    layout = QUANTIZED[fmt](HIDDEN, INTER, bias=True, activation=ACTIVATION)
    banks = HostBanks.allocate(LAYERS, EXPERTS, HIDDEN, INTER, torch.bfloat16, pin=False, progress=False, fmt=layout)
    if fmt.startswith("gguf-"):  # the dummy fill's valid blocks (weights of std 0.02), then the biases
        for layer in range(LAYERS):
            layout.fill_dummy_layer(banks.w13[layer], banks.w2[layer], layer, seed)
            for f in layout.gemm_views(banks.w13[layer], banks.w2[layer]):
                f.bias.copy_(torch.randn(f.bias.shape, generator=g) * BIAS_STD)
        return banks
    for layer in range(LAYERS):
        for f in banks.format.gemm_views(banks.w13[layer], banks.w2[layer]):
            f.q.copy_(torch.randint(0, 256, f.q.shape, generator=g, dtype=torch.uint8))
            if fmt == "mxfp4":  # e8m0 scales around weights of rms 0.2 / sqrt(cols)
                centre = 127 + round(math.log2(0.2 * f.cols**-0.5 / 2.93))
                f.scale.copy_(torch.randint(centre - 1, centre + 3, f.scale.shape, generator=g, dtype=torch.int32))
            else:
                f.scale.copy_(torch.exp2(torch.rand(f.scale.shape, generator=g) * 4 - 3).to(torch.float8_e4m3fn))
                f.gscale.copy_(0.2 * f.cols**-0.5 * torch.exp2(torch.rand(f.gscale.shape, generator=g)))
            f.bias.copy_(torch.randn(f.bias.shape, generator=g) * BIAS_STD)
    return banks


@pytest.fixture(scope="module")
def banks_of():
    made: dict = {}
    return lambda fmt: made.setdefault(fmt, make_banks(fmt))


def compute_dtypes(fmt: str) -> list[torch.dtype]:
    """Plain banks compute in their own dtype (the twin's slots are the bank rows); quantized ones in both."""
    return {"bf16": [torch.bfloat16], "float32": [torch.float32]}.get(fmt, [torch.float32, torch.bfloat16])


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(experts [T, k], router weights [T, k], the pairs token by token in k order): experts shared by tokens."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g) + 0.1
    pairs = [(t, int(experts[t, k]), float(weights[t, k])) for t in range(tokens) for k in range(TOP_K)]
    return experts, weights, pairs


def twin(banks, layer: int, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The reference twin over the bank's rows as its slots: float32 [T, H], each token's rows summed in k order."""
    w13, w2 = banks.format.gemm_views(banks.w13[layer], banks.w2[layer])
    rows = torch.zeros(x.shape[0], TOP_K, HIDDEN, dtype=torch.float32)
    grouped_expert_rows_reference(x, experts, weights, w13, w2, rows)
    out = rows[:, 0].clone()
    for k in range(1, TOP_K):
        out += rows[:, k]
    return out


def mismatch(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why `got` is not `want` within the host kernels' tolerance (test_host_expert_kernel.py's), or None."""
    scale = want.abs().max().item()
    if dtype == torch.float32:
        close = torch.isclose(got, want, rtol=1e-5, atol=1e-6 * scale)
        return None if bool(close.all()) else f"{int((~close).sum())} values past float32's tolerance"
    close = torch.isclose(got, want, rtol=1e-5, atol=1e-6 * scale).float().mean().item()
    loose = torch.isclose(got, want, rtol=2e-2, atol=4e-3 * scale)
    if close <= 0.98 or not bool(loose.all()):
        return f"{close:.1%} within float32's tolerance, {int((~loose).sum())} past a bf16 rounding"
    return None


def x_for(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)) * 4).to(dtype)


def test_the_limit_clamps_most_values_and_the_biases_move_every_output(banks_of):
    """What makes the planted faults visible: the twin's gate and up values mostly past the limit."""
    banks = banks_of("mxfp4")
    w13, _ = banks.format.gemm_views(banks.w13[0], banks.w2[0])
    x = x_for(8, torch.float32)
    h = x @ dequantize_slot(w13, 0, torch.float32).t() + w13.bias[0]
    assert (h.abs() > ACTIVATION.swiglu_limit).float().mean() > 0.5


@needs_library
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("tokens", [1, 8, 21])  # 21: past the 8 tokens a pass of the C rows holds
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_c_kernel_computes_biased_clamped_experts_as_the_twin(banks_of, fmt, tokens, isa):
    banks = banks_of(fmt)
    for dtype in compute_dtypes(fmt):
        x = x_for(tokens, dtype)
        for layer, threads in zip(range(LAYERS), (1, 3)):
            experts, weights, pairs = routing(tokens, layer)
            c = HostExperts(banks, dtype, threads=threads, kernel="c", isa=isa)
            try:
                assert c.backend == "c" and c.c_kernel.swiglu_limit == ACTIVATION.swiglu_limit
                got = c.compute(layer, x, pairs)
            finally:
                c.close()
            assert mismatch(got, twin(banks, layer, x, experts, weights), dtype) is None


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_torch_host_path_computes_biased_clamped_experts_as_the_twin(banks_of, fmt, tokens):
    banks = banks_of(fmt)
    for dtype in compute_dtypes(fmt):
        x = x_for(tokens, dtype)
        experts, weights, pairs = routing(tokens, 1)
        t = HostExperts(banks, dtype, threads=1, kernel="torch")
        try:
            got = t.compute(1, x, pairs)
        finally:
            t.close()
        assert mismatch(got, twin(banks, 1, x, experts, weights), dtype) is None


def plant_in_c(c: HostExperts, fault: str) -> None:
    """The fault in the C kernel's job: no bias offsets, or a limit no value reaches."""
    if fault == "bias dropped":
        for w13, w2 in c.c_kernel.families:
            w13.bias_offset = w2.bias_offset = K.NO_BIAS
    else:
        c.c_kernel.swiglu_limit = 1e30


@needs_library
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("fmt", ("mxfp4", "bf16", "float32", "gguf-q8_0"))
def test_a_c_kernel_that_drops_the_biases_or_the_clamp_is_caught(banks_of, fmt, fault, isa):
    banks = banks_of(fmt)
    for dtype in compute_dtypes(fmt):
        x = x_for(8, dtype)
        experts, weights, pairs = routing(8, 0)
        c = HostExperts(banks, dtype, threads=2, kernel="c", isa=isa)
        try:
            plant_in_c(c, fault)
            got = c.compute(0, x, pairs)
        finally:
            c.close()
        assert mismatch(got, twin(banks, 0, x, experts, weights), dtype) is not None


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("fmt", ("mxfp4", "bf16", "gguf-q8_0"))
def test_a_torch_host_path_that_drops_the_biases_or_the_clamp_is_caught(banks_of, fmt, fault):
    banks = banks_of(fmt)
    for dtype in compute_dtypes(fmt):
        x = x_for(8, dtype)
        experts, weights, pairs = routing(8, 0)
        t = HostExperts(banks, dtype, threads=1, kernel="torch")
        try:
            t.compute(0, x[:1], pairs[:1])  # the reader is made on the first call
            if fault == "bias dropped":
                t._reader.biases = lambda layer, expert: (None, None)
            else:
                t._reader.activation = ExpertActivation(1e30, ACTIVATION.swiglu_alpha)
            got = t.compute(0, x, pairs)
        finally:
            t.close()
        assert mismatch(got, twin(banks, 0, x, experts, weights), dtype) is not None


@needs_library
def test_a_job_with_biases_on_one_projection_only_is_refused(banks_of):
    """Both projections' biases or neither: the C kernel refuses a job with one (a mirror out of step)."""
    c = HostExperts(banks_of("mxfp4"), torch.float32, threads=1, kernel="c", isa="portable")
    try:
        for w13, _ in c.c_kernel.families:
            w13.bias_offset = K.NO_BIAS
        with pytest.raises(RuntimeError, match="an invalid job"):
            c.compute(0, x_for(1, torch.float32), [(0, 1, 1.0)])
    finally:
        c.close()


@needs_library
@pytest.mark.parametrize("fmt", ("mxfp4", "bf16"))
def test_the_decode_graphs_host_node_computes_them_as_the_kernel_and_the_twin(banks_of, fmt):
    """The decode share's jobs (decode_share.py builds its own) carry the activation and the biases: its host
    node, called as the graph calls it, gives the kernel's bits, and those equal the twin."""
    banks = banks_of(fmt)
    kernel = HostKernel(banks, torch.bfloat16, threads=2)
    share = HostDecodeShare(kernel, (1, 1, 0, 0), max_tokens=4, top_k=TOP_K, num_experts=EXPERTS, device="cpu")
    x = x_for(3, torch.bfloat16)
    experts, weights, pairs = routing(3, 2)
    p = share.pinned
    for i, (t, e, w) in enumerate(pairs):
        p.pair_token[i], p.pair_expert[i], p.pair_weight[i] = t, e, w
    p.meta[0], p.meta[1] = 3, len(pairs)
    share._x[:3] = x
    for layer in range(LAYERS):
        share._out.fill_(float("nan"))
        kernel.lib.ferry_host_node(ctypes.addressof(share.tasks[layer]))
        got = share._out[:3].clone()
        assert torch.equal(got, kernel.compute(layer, x, pairs))
        assert mismatch(got, twin(banks, layer, x, experts, weights), torch.bfloat16) is None
    share.check()
    kernel.close()


@needs_library
@pytest.mark.parametrize("isa", isas())
def test_bf16_banks_computed_in_float32_read_their_bf16_biases_alike(banks_of, isa):
    """Plain bf16 banks in float32 compute (no twin: its slots and x share a dtype): the C kernel reads the bias
    rows as bf16 as the torch path converts them, and both differ from the unbiased experts."""
    banks = banks_of("bf16")
    x = x_for(8, torch.float32)
    _, _, pairs = routing(8, 3)
    c = HostExperts(banks, torch.float32, threads=2, kernel="c", isa=isa)
    t = HostExperts(banks, torch.float32, threads=1, kernel="torch")
    try:
        got, want = c.compute(1, x, pairs), t.compute(1, x, pairs)
        assert mismatch(got, want, torch.float32) is None
        plant_in_c(c, "bias dropped")
        assert mismatch(c.compute(1, x, pairs), want, torch.float32) is not None
    finally:
        c.close()
        t.close()


# Gemma's experts: gelu_tanh(gate) * up, no biases, in plain banks of the run dtype or packed banks (bf16's default)
GELU_FORMATS = ("float32", "bf16", "packed")


def make_gelu_banks(fmt: str, seed: int = 0):
    """Random gelu experts in `fmt`'s banks: plain (float32, bf16), or packed from the same values as bf16's.
    Weights of rms 0.5 / sqrt(cols) put the gate values (x_for's x) around 2, where gelu's tanh approximation,
    its erf form and SiLU differ most."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    layout = Bf16Experts(HIDDEN, INTER, dtype, activation=GELU_TANH_AND_MUL)
    plain = HostBanks.allocate(LAYERS, EXPERTS, HIDDEN, INTER, dtype, pin=False, progress=False, fmt=layout)
    for layer in range(LAYERS):
        for rows, cols in ((plain.w13[layer], HIDDEN), (plain.w2[layer], INTER)):
            rows.copy_(torch.randn(rows.shape, generator=g) * 0.5 * cols**-0.5)
    if fmt != "packed":
        return plain
    packed = PackedHostBanks.allocate(
        LAYERS, EXPERTS, HIDDEN, INTER, pin=False, progress=False, activation=GELU_TANH_AND_MUL
    )
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            w13, w2 = plain.w13[layer][e], plain.w2[layer][e]
            packed.load_expert(layer, e, w13[:INTER], w13[INTER:], w2)
    packed.seal()
    return packed


@pytest.fixture(scope="module")
def gelu_banks_of():
    made: dict = {}
    return lambda fmt: made.setdefault(fmt, make_gelu_banks(fmt))


def gelu_reference(gelu_banks_of, fmt: str, layer: int, x: torch.Tensor, pairs: list, activation=None) -> torch.Tensor:
    """The torch host path over plain banks of the same values (packed: bf16's), whose activation is the plain
    format's own (F.gelu's tanh approximation), or `activation` planted in its reader."""
    t = HostExperts(gelu_banks_of("bf16" if fmt == "packed" else fmt), x.dtype, threads=1, kernel="torch")
    try:
        if activation is not None:
            t.compute(layer, x[:1], pairs[:1])  # the reader is made on the first call
            t._reader.activation = activation
        return t.compute(layer, x, pairs)
    finally:
        t.close()


@needs_library
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fmt", GELU_FORMATS)
def test_the_c_kernel_computes_gelu_experts_as_the_torch_path(gelu_banks_of, fmt, isa):
    """Gemma's experts on the host: the C kernel's gelu_tanh rows (float32, and bf16 rounded op by op as torch
    rounds them) equal the torch path's within the host kernels' tolerance, for 1 and 21 tokens; so does the torch
    path over packed banks, which carry the model's activation."""
    banks = gelu_banks_of(fmt)
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    for tokens, layer, threads in ((1, 0, 1), (21, 1, 3)):
        x = x_for(tokens, dtype)
        _, _, pairs = routing(tokens, layer)
        want = gelu_reference(gelu_banks_of, fmt, layer, x, pairs)
        c = HostExperts(banks, dtype, threads=threads, kernel="c", isa=isa)
        try:
            assert c.backend == "c" and c.c_kernel.activation == GELU_TANH_CODE
            assert mismatch(c.compute(layer, x, pairs), want, dtype) is None
        finally:
            c.close()
        if fmt == "packed":
            t = HostExperts(banks, dtype, threads=1, kernel="torch")
            try:
                assert mismatch(t.compute(layer, x, pairs), want, dtype) is None
            finally:
                t.close()


@needs_library
@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fault", ("silu in the kernel", "erf gelu in the reference"))
@pytest.mark.parametrize("fmt", GELU_FORMATS)
def test_gelu_experts_computed_with_another_activation_are_caught(gelu_banks_of, fmt, fault, isa):
    """What the comparison above tells apart: the kernel's job asking for SiLU, or a reference computing gelu's
    erf form rather than its tanh approximation."""
    banks = gelu_banks_of(fmt)
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    x = x_for(8, dtype)
    _, _, pairs = routing(8, 0)
    erf = (lambda gate, up: F.gelu(gate) * up) if fault.startswith("erf") else None
    want = gelu_reference(gelu_banks_of, fmt, 0, x, pairs, activation=erf)
    c = HostExperts(banks, dtype, threads=2, kernel="c", isa=isa)
    try:
        if fault == "silu in the kernel":
            c.c_kernel.activation = SILU_CODE
        assert mismatch(c.compute(0, x, pairs), want, dtype) is not None
    finally:
        c.close()


@needs_library
def test_an_activation_the_c_kernel_lacks_is_refused_not_computed_as_silu(gelu_banks_of):
    """The kernel is never handed an activation it does not compute: HostKernel refuses it by name (HostExperts'
    auto then keeps the torch path), and the C side refuses a job with an unknown code."""
    banks = gelu_banks_of("float32")
    clamped_gelu = ExpertActivation(swiglu_limit=1.0, gelu_tanh=True)  # the kernel has no clamp for its gelu
    other = HostBanks.allocate(
        LAYERS, EXPERTS, HIDDEN, INTER, torch.float32, pin=False, progress=False,
        fmt=Bf16Experts(HIDDEN, INTER, torch.float32, activation=clamped_gelu),
    )  # fmt: skip
    with pytest.raises(K.KernelUnavailable, match=r"not these experts' activation .*gelu_tanh=True"):
        HostKernel(other, torch.float32, threads=1)
    auto = HostExperts(other, torch.float32, threads=1, kernel="auto")
    try:
        assert auto.backend == "torch"
    finally:
        auto.close()
    c = HostExperts(banks, torch.float32, threads=1, kernel="c", isa="portable")
    try:
        c.c_kernel.activation = max(K.ACTIVATIONS) + 1
        with pytest.raises(RuntimeError, match="an invalid job"):
            c.compute(0, x_for(1, torch.float32), [(0, 1, 1.0)])
    finally:
        c.close()
