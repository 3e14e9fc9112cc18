"""The expert formats on the worker (docs/ARCHITECTURE.md §3, "Expert formats"): one module each.

* `bf16.py`: experts in the run dtype, in slots [S, 2I, H] / [S, H, I] and host banks alike;
* `bf16-packed`: bf16's slots, with host banks packed losslessly to 12 bits a value: its module is
  offload/host_memory/packed_banks.py (`--expert-bank-format`; auto packs bf16 models that offload);
* `nvfp4.py`, `fp8_block.py`: the checkpoint's quantized experts kept quantized in host RAM, across
  PCIe and in their slots (one byte row per weight family: plan/expert_formats.py prices it), and
  computed from there by the kernels, which dequantize in registers (kernels/quantized_experts.py).
Each checks an expert's checkpoint shapes with `expert_shapes.py`, which the packed banks share.

Every format answers the same questions (`ExpertFormat`): how one expert's checkpoint tensors are
written into a slot or bank row, what the expert GEMV/GEMM read (views of the slot tensors), and
how `--load-format dummy` fills a layer. The stores and the banks hold one and never look inside.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ferry.plan import expert_formats as F
from ferry.plan.model_config import ModelSpec


class ExpertFormat(Protocol):
    name: str  # bf16 | nvfp4 | fp8-block (the slots' format; bf16-packed differs only in its banks)
    quantized: bool

    def row_shapes(self) -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]:
        """((shape, dtype) of one expert's w13 row, of its w2 row), as a slot and a bank hold them."""

    def write_expert(self, dst13: torch.Tensor, dst2: torch.Tensor, gate, up, down, where: str) -> None:
        """One expert's checkpoint tensors (gate, up [I, H], down [H, I]: tensors, or QuantizedWeights
        for a quantized format) into its rows; a ValueError naming `where` for the wrong kind."""

    def gemm_views(self, w13: torch.Tensor, w2: torch.Tensor):
        """What the expert kernels read for slot tensors w13 [S, ...] and w2 [S, ...]."""

    # quantized formats also have fill_dummy_layer(w13 [E, ...], w2 [E, ...], layer, seed): --load-format
    # dummy's deterministic weights for one MoE layer's rows (bf16 ones come from dummy_weights.py)


def expert_format_for(spec: ModelSpec, dtype: torch.dtype) -> ExpertFormat:
    """The slots' format for this model (the checkpoint's quantized format, else the run dtype)."""
    fmt = F.slot_format(spec)
    if fmt == F.NVFP4:
        from ferry.services.worker.expert_formats.nvfp4 import Nvfp4Experts

        return Nvfp4Experts(spec.hidden_size, spec.moe_intermediate_size)
    if fmt == F.FP8_BLOCK:
        from ferry.services.worker.expert_formats.fp8_block import Fp8BlockExperts

        return Fp8BlockExperts(spec.hidden_size, spec.moe_intermediate_size)
    from ferry.services.worker.expert_formats.bf16 import Bf16Experts

    return Bf16Experts(spec.hidden_size, spec.moe_intermediate_size, dtype)
