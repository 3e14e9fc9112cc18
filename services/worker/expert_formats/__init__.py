"""The expert formats on the worker (docs/ARCHITECTURE.md §3, "Expert formats"): one module each, beside
its plan side of the same name under plan/expert_formats/ (which registers it and names its class here).

* `bf16.py`: experts in the run dtype, in slots [S, 2I, H] / [S, H, I] and host banks alike;
* `bf16_packed.py`: bf16's slots, with host banks packed losslessly to 12 bits a value
  (offload/host_memory/packed_banks.py holds them; `--expert-bank-format`, auto packs bf16 models that offload);
* `nvfp4.py`, `mxfp4.py`, `fp8_block.py`: the checkpoint's quantized experts kept quantized in host RAM, across
  PCIe and in their slots (one byte row per weight family: plan/expert_formats prices it), and
  computed from there by the kernels, which dequantize in registers (kernels/quantized_experts.py).
Each checks an expert's checkpoint shapes with `expert_shapes.py`, which the packed banks share.

Every format answers the same questions (`ExpertFormat`, below): how one expert's checkpoint tensors are
written into a slot or bank row, what the expert GEMV/GEMM read (views of the slot tensors, which pick
the kernel), how the host computes from its banks (the C kernel's code, the torch reader), and how
`--load-format dummy` fills a layer. The stores and the banks hold one and never look inside.

A new format's worker module gives a class with ExpertFormat's members (a quantized one subclasses
quantized.QuantizedExperts: `_write`, `_fill_dummy`, `host_kernel_code`, `family_reader`, and
`quantize_linear` if `ferry make-bench-model` writes it); its plan module's `worker` names that class.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

import torch

from ferry.kernels.expert_epilogue import GELU_TANH_AND_MUL, SILU_AND_MUL, ExpertActivation
from ferry.plan import expert_formats as F
from ferry.plan.model_spec import CLAMPED_SWIGLU, GELU_TANH, SILU, ModelSpec

if TYPE_CHECKING:
    from ferry.plan.planner import Plan


class ExpertFormat(Protocol):
    plan: F.ExpertFormat  # its plan side (plan/expert_formats)
    name: str  # the plan's name for it (`float32` for bf16's rows in float32)
    quantized: bool  # byte rows it fills and views itself; else [2I, H] / [H, I] in the run dtype
    copy_engine_default: bool  # --expert-copy-engine-tokens defaults on for its banks (services/worker/flags.py)
    # its gemm_views differ by MoE layer (rows of per-layer types: gguf_mixed.py, which then gives the bytes of the
    # rows a layer fills, layer_row_nbytes(moe_layer))
    views_per_layer: bool

    def row_shapes(self) -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]:
        """((shape, dtype) of one expert's w13 row, of its w2 row), as a slot holds them."""

    def write_expert(self, dst13: torch.Tensor, dst2: torch.Tensor, gate, up, down, where: str, bias=None) -> None:
        """One expert's checkpoint tensors (gate, up [I, H], down [H, I]: tensors, or QuantizedWeights
        for a quantized format) into its rows; a ValueError naming `where` for the wrong kind. `bias`
        (expert_shapes.ExpertBias), for a format that holds biases (its `for_shapes` epilogue)."""

    def gemm_views(self, w13: torch.Tensor, w2: torch.Tensor, moe_layer: int | None = None):
        """What the expert kernels read for slot tensors w13 [S, ...] and w2 [S, ...]: the tensors (bf16's
        kernels), or kernels/quantized_experts.py's QuantizedFamily (the quantized kernels). The same for every
        MoE layer unless `views_per_layer`: then MoE layer `moe_layer`'s (which it needs)."""

    def host_kernel_format(self) -> int:
        """The C host kernel's code for banks of this format (offload/host_compute/host_expert_kernel.py), or
        KernelUnavailable."""

    def host_bias_offsets(self) -> tuple[int, int]:
        """Where the C host kernel finds an expert's biases in its w13 and w2 rows: bytes from the row's start
        (host_expert_kernel.NO_BIAS without biases); read where `host_kernel_format` gives a code."""

    def host_reader(self, banks, dtype: torch.dtype, chunk: int):
        """The torch host path's reader of these banks (offload/host_compute/host_expert_weights.py), computing in
        `dtype`, with the experts' biases and activation."""

    # quantized formats also have fill_dummy_layer(w13 [E, ...], w2 [E, ...], layer, seed): --load-format
    # dummy's deterministic weights for one MoE layer's rows (bf16 ones come from dummy_weights.py)


def worker_class(fmt: F.ExpertFormat) -> type:
    """The worker class the plan's format names (its `worker`, "module:Class")."""
    module, _, name = fmt.worker.partition(":")
    return getattr(importlib.import_module(module), name)


def expert_epilogue(spec: ModelSpec) -> tuple[tuple[int, int], ExpertActivation] | None:
    """(bias rows, activation) of experts with biases or an activation other than silu(gate) * up, else None:
    what a format that holds them (`holds_biases`, plan/model_config.py checks) takes as `for_shapes`' epilogue."""
    if not spec.expert_bias and spec.expert_activation == SILU:
        return None
    activation = {
        SILU: SILU_AND_MUL,
        CLAMPED_SWIGLU: ExpertActivation(spec.swiglu_limit, spec.swiglu_alpha),
        GELU_TANH: GELU_TANH_AND_MUL,
    }[spec.expert_activation]
    return F.format_of(spec).bias_rows(spec), activation


def _for_shapes(fmt: F.ExpertFormat, spec: ModelSpec, dtype: torch.dtype) -> ExpertFormat:
    epilogue = expert_epilogue(spec)
    cls = worker_class(fmt)
    options = fmt.worker_options(spec)
    if epilogue is None:
        return cls.for_shapes(spec.hidden_size, spec.moe_intermediate_size, dtype, **options)
    return cls.for_shapes(spec.hidden_size, spec.moe_intermediate_size, dtype, epilogue, **options)


def expert_format_for(spec: ModelSpec, dtype: torch.dtype) -> ExpertFormat:
    """The slots' format for this model (the checkpoint's quantized format, else the run dtype's)."""
    return _for_shapes(F.format_of(spec), spec, dtype)


def bank_format_for(spec: ModelSpec, plan: Plan) -> ExpertFormat:
    """The host banks' format for this model and plan (its --expert-bank-format word)."""
    fmt = F.banks_format(spec, plan.host.expert_bank_format, plan.dtype)
    return _for_shapes(fmt, spec, _torch_dtype(plan.dtype))


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
