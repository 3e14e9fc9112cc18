"""Writing checkpoints in the published quantized layouts: what `ferry make-bench-model --format` writes,
and how the tests make quantized tiny models (plan/quantization.py reads them back).

* `nvfp4`: nvidia modelopt's NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4`): per quantized
  linear `weight` uint8 [O, IN/2] (two e2m1 codes, element 2j in the low nibble), `weight_scale`
  float8_e4m3fn [O, IN/16], `weight_scale_2` fp32 (= amax / (6 x 448)) and `input_scale` fp32,
  as modelopt computes them: weight ~ e2m1 x weight_scale x weight_scale_2. Quantized: every MLP
  linear but the routers, so the routed and the shared experts (as nvidia's Qwen3.5/3.6 NVFP4 releases)
  and a dense layer's MLP (GLM-4.5's, as FreeToken 0.1.2's GLM reader needs); everything else is listed in
  `exclude_modules` and stays bf16.
* `fp8`: Qwen's `-FP8` releases (`quant_method: fp8`, `weight_block_size: [128, 128]`): `weight`
  float8_e4m3fn and `weight_scale_inv` fp32 [ceil(O/128), ceil(IN/128)] (amax / 448 of each block,
  multiplied back), on every linear but the router, the shared expert's gate, the Gated DeltaNet's
  `in_proj_b`/`in_proj_a` and lm_head (`modules_to_not_convert`).
* `mxfp4`: gpt-oss's MXFP4 (`quant_method: mxfp4`), per quantized linear `weight_blocks` uint8
  [O, IN/32, 16] (two e2m1 codes a byte, element 2j in the low nibble) and `weight_scales` uint8 [O, IN/32]
  (e8m0: 2^(s - 127)), each group's scale the smallest power of two that holds its largest value. Quantized:
  the routed experts (as gpt-oss); everything else is listed in `modules_to_not_convert` and stays bf16.

Rounding is round-to-nearest on the e2m1 grid (a tie to the smaller magnitude) and torch's float8
cast. A reader is held to these files by what they say, not by how they were rounded.

Each layout is its expert format's (plan/expert_formats/<format>.py: `checkpoint_layout`, which linears
it quantizes, its quantization_config; services/worker/expert_formats/<format>.py: `quantize_linear`,
the tensors of one linear). torch is imported where tensors are made: `ferry make-bench-model` is a
control-plane command and imports this module before it knows whether it will write weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.plan import expert_formats as F
from ferry.plan.expert_formats.registry import CHECKPOINT_BF16_LINEARS

if TYPE_CHECKING:
    import torch


def layout_format(layout: str) -> F.ExpertFormat:
    """The expert format whose published layout `layout` (`ferry make-bench-model --format`) quantizes."""
    fmt = F.for_checkpoint_layout(layout)
    if not fmt.quantized:
        quantized = [f.checkpoint_layout for f in F.registered() if f.quantized and f.checkpoint_layout]
        raise ValueError(f"--format must be one of {', '.join(quantized)}, got {layout!r}")
    return fmt


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".weight") and tensor.dim() == 2 and "norm" not in name and "embed_tokens" not in name


def quantized_in(fmt: str, name: str, tensor: torch.Tensor) -> bool:
    """Whether checkpoint tensor `name` is quantized in the layout `fmt` writes."""
    if not is_linear_weight(name, tensor) or name.endswith(CHECKPOINT_BF16_LINEARS) or name.startswith("lm_head"):
        return False
    return layout_format(fmt).checkpoint_quantizes(name)


def quantize_tensors(fmt: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict in checkpoint names -> the same checkpoint in layout `fmt`."""
    from ferry.services.worker.expert_formats import worker_class

    quantize = worker_class(layout_format(fmt)).quantize_linear
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not quantized_in(fmt, name, t):
            out[name] = t
            continue
        module = name.removesuffix(".weight")
        out.update({f"{module}.{leaf}": v for leaf, v in quantize(t).items()})
    return out


def quantization_config(fmt: str, names: list[str]) -> dict:
    """config.json's `quantization_config` for a checkpoint of these tensor names (before quantizing)."""
    modules = sorted({n.removesuffix(".weight") for n in names if n.endswith(".weight")})
    return layout_format(fmt).checkpoint_config(modules)
