"""Quantized experts on CUDA (issue 21): the NVFP4, MXFP4, FP8-block and GGUF kernels at real shapes against their
dequantizing twin, and decoding of quantized tiny checkpoints token for token across every path that
must not change a bit: graph replay == eager, offloaded (graphs, eager, copy engine, a prefill streamed
past the cache) == all-resident, for quantized checkpoints and GGUF files. (Prefetch on and off is the bf16 tests'
concern: it moves the same bytes.)"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from tests.gpu.test_device_decode_cuda import _boot, _greedy_batch
from tests.quantized_models import LAYOUT_FORMATS

LAYOUTS = ("modelopt-nvfp4", "fp8", "mxfp4")


def _family(fmt: str, slots: int, hidden: int, inter: int, seed: int):
    """Random (w13, w2) QuantizedFamily views over slot rows on the GPU, as the pool holds them."""
    from ferry.plan import expert_formats
    from ferry.services.worker.expert_formats import worker_class
    from ferry.services.worker.expert_formats.fp8_block import Fp8BlockExperts
    from ferry.services.worker.expert_formats.mxfp4 import Mxfp4Experts
    from ferry.services.worker.expert_formats.nvfp4 import Nvfp4Experts

    formats = {"nvfp4": Nvfp4Experts, "mxfp4": Mxfp4Experts, "fp8-block": Fp8BlockExperts}
    experts = (formats[fmt] if fmt in formats else worker_class(expert_formats.get(fmt)))(hidden, inter)
    (s13, d13), (s2, d2) = experts.row_shapes()
    w13, w2 = torch.zeros(slots, *s13, dtype=d13), torch.zeros(slots, *s2, dtype=d2)
    experts.fill_dummy_layer(w13, w2, layer=0, seed=seed)
    return experts.gemm_views(w13.cuda(), w2.cuda())


# every GGUF block type (kernels/gguf_block_decode.py): 2048 and 512 are whole 256-value blocks (K-quants, IQ4_XS)
GGUF_FORMATS = ["gguf-q8_0", "gguf-q4_0", "gguf-q4_1", "gguf-q5_0", "gguf-q5_1", "gguf-q4_k", "gguf-q5_k"]
GGUF_FORMATS += ["gguf-q6_k", "gguf-iq4_nl", "gguf-iq4_xs", "gguf-mxfp4"]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "fp8-block", *GGUF_FORMATS])
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_quantized_kernels_equal_their_twin_at_35b_shapes(cuda_device, fmt, tokens):
    from ferry.kernels.grouped_expert_gemm import grouped_expert_forward
    from ferry.kernels.grouped_expert_gemm_reference import quantized_expert_rows_reference

    torch.manual_seed(0)
    w13, w2 = _family(fmt, 24, 2048, 512, seed=1)
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 24, (tokens, 8), device="cuda", dtype=torch.int32)
    weights = torch.softmax(torch.randn(tokens, 8, device="cuda"), -1)
    got = grouped_expert_forward(x, ids, weights, w13, w2).float()
    rows = torch.zeros(tokens, 8, 2048, device="cuda")
    quantized_expert_rows_reference(x, ids, weights, w13, w2, rows)
    want = rows.sum(1)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max() + 1e-6


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "gguf-mxfp4"])
@pytest.mark.parametrize("tokens", [1, 4, 300])
def test_fp4_kernels_with_gpt_oss_epilogue_equal_their_twin_at_20b_shapes(cuda_device, fmt, tokens):
    """gpt-oss-20b's experts (H = I = 2880, top-4) in an fp4 format (or GGUF's MXFP4 blocks, ggml-org's files):
    float32 biases in each slot row and the clamped SwiGLU at a limit the projections reach, through the pair
    (decode) or grouped (prefill) kernel."""
    import dataclasses

    from ferry.kernels.expert_epilogue import ExpertActivation
    from ferry.kernels.grouped_expert_gemm import grouped_expert_forward
    from ferry.kernels.grouped_expert_gemm_reference import quantized_expert_rows_reference

    torch.manual_seed(0)
    w13, w2 = _family(fmt, 24, 2880, 2880, seed=2)
    clamped = ExpertActivation(swiglu_limit=0.5, swiglu_alpha=1.702)
    w13 = dataclasses.replace(w13, bias=0.5 * torch.randn(24, 2 * 2880, device="cuda"), activation=clamped)
    w2 = dataclasses.replace(w2, bias=0.5 * torch.randn(24, 2880, device="cuda"))
    x = torch.randn(tokens, 2880, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 24, (tokens, 4), device="cuda", dtype=torch.int32)
    weights = torch.softmax(torch.randn(tokens, 4, device="cuda"), -1)
    got = grouped_expert_forward(x, ids, weights, w13, w2).float()
    rows = torch.zeros(tokens, 4, 2880, device="cuda")
    quantized_expert_rows_reference(x, ids, weights, w13, w2, rows)
    want = rows.sum(1)
    plain = torch.zeros_like(rows)
    quantized_expert_rows_reference(
        x, ids, weights, dataclasses.replace(w13, bias=None, activation=ExpertActivation()),
        dataclasses.replace(w2, bias=None), plain,
    )  # fmt: skip
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max() + 1e-6
    assert (plain.sum(1) - want).abs().max() > 0.1 * want.abs().max(), "the epilogue changed nothing"


# 95 prompt tokens in one step: a prefill streamed past the cache when offloaded; then 3-row decode steps
DECODE_VARIANTS = {
    "resident-eager": ["--enforce-eager"],
    "resident-graphs": [],
    "offload-graphs": ["--moe-cache-size", "10"],
    "offload-eager": ["--moe-cache-size", "10", "--enforce-eager"],
    "offload-copy-engine": ["--moe-cache-size", "10", "--expert-copy-engine-tokens", "2"],
}


def _variants_decode_alike(model, dtype: str, want_format: str, seed: int, what: str) -> None:
    """`model` booted in each of DECODE_VARIANTS with its experts held as `want_format`: three prompts of 95 tokens
    in all greedily decoded 10 steps, token for token as all-resident eager decoding."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 250, n).tolist() for n in (40, 25, 30)]
    runs = {}
    for name, flags in DECODE_VARIANTS.items():
        executor, plan = _boot(model, dtype, *flags)
        assert plan.experts.format == want_format
        assert executor.expert_cache_report()["expert_format"] == want_format
        assert (executor.graphs is None) == ("--enforce-eager" in flags)
        runs[name] = _greedy_batch(executor, prompts, steps=10)
        if "--moe-cache-size" in flags:
            report = executor.expert_cache_report()
            assert report["misses"] > 0 and report["bytes_copied"] % plan.experts.bytes_per_slot == 0
        del executor
        gc.collect()
        torch.cuda.empty_cache()
    want = runs.pop("resident-eager")
    for name, got in runs.items():
        assert got == want, f"{name} differs from all-resident eager decoding ({what})"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch, dtype", [("qwen3_moe", "float32"), ("qwen3_5_moe", "bfloat16")])
def test_quantized_checkpoints_decode_token_for_token(cuda_device, quantized_tiny_models, layout, arch, dtype):
    model = quantized_tiny_models(arch, layout)
    _variants_decode_alike(model, dtype, LAYOUT_FORMATS[layout], 3, f"{layout}, {arch}")


@pytest.mark.parametrize("expert_type", ["Q4_K_M", "IQ4_XS"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_files_decode_token_for_token(cuda_device, tmp_path_factory, expert_type, dtype):
    """A tiny GGUF file's experts kept in its blocks (Q4_K_M: a gguf-mixed file, down Q6_K on its last layer and
    every slot, staging bay and bank row sized for it; IQ4_XS: one type): graph replay == eager, offloaded (graphs,
    eager, copy engine, a prefill streamed past the cache) == all-resident, token for token."""
    from ferry.plan.model_config import load_model_config
    from tests.gguf_models import tiny_gguf

    path, _ = tiny_gguf(tmp_path_factory.mktemp(f"gguf-{expert_type}"), expert_type)
    want_format = "gguf-mixed" if expert_type == "Q4_K_M" else f"gguf-{expert_type.lower()}"
    assert load_model_config(path).quantization.expert_format == want_format
    _variants_decode_alike(path, dtype, want_format, 4, f"{expert_type}, {dtype}")
