"""GPU tests compare against transformers' plain-torch implementation of each model.

When fla-core is importable, transformers swaps its Gated DeltaNet and conv functions for fla's
kernels at import time, whatever device the tensors are on (and fla's Triton kernels then fail
on CPU tensors). The reference must be transformers' own math, so every function it decorated
with a kernel fallback is put back to the torch function it wraps."""

from __future__ import annotations

import importlib

import pytest

REFERENCE_MODULES = (
    "transformers.models.qwen3_next.modeling_qwen3_next",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
)
KERNEL_FALLBACK_FUNCTIONS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


@pytest.fixture(autouse=True)
def transformers_torch_reference(monkeypatch):
    for name in REFERENCE_MODULES:
        module = importlib.import_module(name)
        for fn_name in KERNEL_FALLBACK_FUNCTIONS:
            fn = getattr(module, fn_name, None)
            original = getattr(fn, "__wrapped__", None)
            if original is not None:
                monkeypatch.setattr(module, fn_name, original)


@pytest.fixture(scope="session")
def cuda_device():
    """The CUDA device Ferry's APIs are given here, resolved (and made current) as boot does it."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ferry.services.worker.device import select_device

    return select_device("cuda")
