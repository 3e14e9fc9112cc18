"""A quantized linear of a checkpoint, as read: its parts gathered into one `QuantizedWeight`.

A quantized checkpoint (plan/quantization.py) stores each quantized linear as a weight and its
scales, under names beside the weight's (`...q_proj.weight`, `...q_proj.weight_scale`, ...), in
any order and any shard. `group_quantized_tensors` buffers a module's parts until the last one has
been read (the names of every tensor are known from the headers before the first is read), then
yields the module once, as `(module.weight, QuantizedWeight)`: the model's loader sees one tensor
per linear, whatever the format. Which linear is quantized is decided by the tensors present:

| format | tensors | weight |
| --- | --- | --- |
| nvfp4 (modelopt) | `weight` uint8 [O, IN/2], `weight_scale` f8 [O, IN/16], | e2m1 x scale x scale_2 |
| | `weight_scale_2` f32 | |
| nvfp4 (compressed-tensors) | `weight_packed`, `weight_scale`, `weight_global_scale` | e2m1 x scale / global |
| fp8-block (Qwen `-FP8`) | `weight` f8 [O, IN], `weight_scale_inv` [ceil(O/128), ceil(IN/128)] | f8 x block scale |
| fp8 per tensor (modelopt FP8) | `weight` f8 [O, IN], `weight_scale` f32 (one value) | f8 x scale |
| mxfp4 (gpt-oss, per linear) | `weight_blocks` uint8 [O, IN/32, 16], `weight_scales` u8 [O, IN/32] | e2m1 x 2^(s-127) |

Activation scales (`input_scale`, `input_global_scale`) and KV-cache scales (`k_scale`, `v_scale`)
are read and dropped: Ferry keeps activations and the KV cache in the run dtype. Dense weights are
dequantized once at load (`dequantize`); routed experts stay quantized (`services/worker/expert_formats`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ferry.kernels.quantized_experts import dequantize_fp8_blocks, dequantize_mxfp4, dequantize_nvfp4
from ferry.plan.expert_formats import FP8_BLOCK, FP8_BLOCK_SIZE, MXFP4, MXFP4_GROUP, NVFP4, NVFP4_GROUP
from ferry.plan.expert_formats.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX
from ferry.plan.quantization import DROPPED_SUFFIXES, QUANT_SUFFIXES, WEIGHT_SUFFIXES
from ferry.shared.errors import ModelLoadError

FP8_TENSOR = "fp8-tensor"  # modelopt's per-tensor FP8 (dense linears; experts are held as fp8-block)


class QuantizedWeightError(ModelLoadError):
    """A quantized linear's tensors are incomplete or inconsistent."""


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized linear [O, IN]: `q` (nvfp4, mxfp4: uint8 [O, IN/2], fp8: float8_e4m3fn [O, IN]),
    `scale` (nvfp4: float8 [O, IN/16]; mxfp4: e8m0 uint8 [O, IN/32]; fp8-block: float32 [ceil(O/128),
    ceil(IN/128)]; fp8 per tensor: float32 [1]) and, for nvfp4, `global_scale`, the per-tensor
    multiplier (float32 [1])."""

    fmt: str
    q: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    source: str  # the checkpoint name of its weight, for messages

    @property
    def shape(self) -> tuple[int, int]:
        o, n = self.q.shape
        return (o, 2 * n) if self.fmt in (NVFP4, MXFP4) else (o, n)

    def dequantize(self, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """The dense weight [O, IN] in `dtype` (float32 math, one rounding)."""
        q = self.q.to(device) if device is not None else self.q
        scale = self.scale.to(q.device)
        if self.fmt == NVFP4:
            return dequantize_nvfp4(q, scale, self.global_scale.to(q.device), dtype)
        if self.fmt == MXFP4:
            return dequantize_mxfp4(q, scale, dtype)
        if self.fmt == FP8_BLOCK:
            return dequantize_fp8_blocks(q, scale, q.shape[0], dtype)  # one projection: one part
        return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def split_module(name: str) -> tuple[str, str]:
    """`a.b.q_proj.weight_scale` -> (`a.b.q_proj`, `weight_scale`)."""
    module, _, leaf = name.rpartition(".")
    return module, leaf


def quantized_modules(names: Iterable[str]) -> dict[str, set[str]]:
    """The modules that carry quantization tensors, with the names of all their tensors."""
    by_module: dict[str, set[str]] = {}
    for name in names:
        module, leaf = split_module(name)
        if leaf in (*WEIGHT_SUFFIXES, *QUANT_SUFFIXES):
            by_module.setdefault(module, set()).add(name)
    return {m: n for m, n in by_module.items() if any(split_module(x)[1] in QUANT_SUFFIXES for x in n)}


def group_quantized_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], names: Iterable[str]
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's (name, tensor) stream with each quantized module's parts replaced by one
    (`module.weight`, QuantizedWeight), yielded when its last part has been read."""
    modules = quantized_modules(names)
    owner = {n: m for m, ns in modules.items() for n in ns}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module = owner.get(name)
        if module is None:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[split_module(name)[1]] = tensor
        if len(parts) == len(modules[module]):
            del pending[module]
            if all(leaf in DROPPED_SUFFIXES for leaf in parts):
                continue  # e.g. k_scale / v_scale on an attention module: nothing to load
            yield f"{module}.weight", quantized_weight(module, parts)
    if pending:
        raise QuantizedWeightError(f"quantized modules left incomplete: {', '.join(sorted(pending)[:4])}")


def quantized_weight(module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
    """Classify and check one module's parts (see the module docstring's table)."""
    if BLOCKS_SUFFIX in parts:
        return mxfp4_weight(module, parts)
    source = f"{module}.weight"
    weight = parts.get("weight", parts.get("weight_packed"))
    if weight is None:
        raise QuantizedWeightError(f"checkpoint module {module!r} has scales {sorted(parts)} but no weight")
    if weight.dtype == torch.uint8:
        if "weight_scale" not in parts or not ({"weight_scale_2", "weight_global_scale"} & parts.keys()):
            raise QuantizedWeightError(
                f"nvfp4 weight {source!r} needs weight_scale and weight_scale_2 "
                f"(or weight_global_scale); the checkpoint has {sorted(parts)}"
            )
        scale = parts["weight_scale"]
        if "weight_scale_2" in parts:  # modelopt: multiplied
            g = parts["weight_scale_2"].to(torch.float32).reshape(-1)[:1]
        else:  # compressed-tensors stores the inverse (its weight is code x scale / global scale)
            g = (1.0 / parts["weight_global_scale"].to(torch.float64).reshape(-1)[:1]).to(torch.float32)
        o, half = weight.shape
        if (
            weight.dim() != 2
            or tuple(scale.shape) != (o, 2 * half // NVFP4_GROUP)
            or scale.dtype != torch.float8_e4m3fn
        ):
            raise QuantizedWeightError(
                f"nvfp4 weight {source!r}: weight_scale is {scale.dtype} {tuple(scale.shape)}, "
                f"expected float8_e4m3fn {(o, 2 * half // NVFP4_GROUP)}"
            )
        return QuantizedWeight(NVFP4, weight, scale, g, source)
    if weight.dtype == torch.float8_e4m3fn:
        o, n = weight.shape
        if "weight_scale_inv" in parts:
            scale = parts["weight_scale_inv"].to(torch.float32)
            want = (-(-o // FP8_BLOCK_SIZE), -(-n // FP8_BLOCK_SIZE))
            if tuple(scale.shape) != want:
                raise QuantizedWeightError(
                    f"fp8 weight {source!r}: weight_scale_inv has shape {tuple(scale.shape)}, "
                    f"expected {want} for 128 x 128 blocks"
                )
            return QuantizedWeight(FP8_BLOCK, weight, scale, None, source)
        if "weight_scale" in parts and parts["weight_scale"].numel() == 1:
            return QuantizedWeight(FP8_TENSOR, weight, parts["weight_scale"].to(torch.float32).reshape(1), None, source)
        raise QuantizedWeightError(
            f"fp8 weight {source!r} needs weight_scale_inv (128 x 128 blocks) or a "
            f"per-tensor weight_scale; the checkpoint has {sorted(parts)}"
        )
    raise QuantizedWeightError(
        f"checkpoint module {module!r} has quantization scales but its weight is "
        f"{weight.dtype}; expected uint8 (nvfp4) or float8_e4m3fn (fp8)"
    )


def row_slice(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Rows start..stop of a quantized linear whose scales are per row (nvfp4, mxfp4: codes and scales slice
    alike), e.g. the gate's and the up's halves of a fused gate/up projection."""
    if weight.fmt not in (NVFP4, MXFP4):
        raise QuantizedWeightError(f"{weight.source}: {weight.fmt} scales span rows; it cannot be split by rows")
    return QuantizedWeight(
        weight.fmt, weight.q[start:stop], weight.scale[start:stop], weight.global_scale, weight.source
    )


def mxfp4_weight(module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
    """One mxfp4 linear from its `weight_blocks` uint8 [O, IN/32, 16] and `weight_scales` uint8 [O, IN/32]:
    the blocks' bytes are the codes [O, IN/2] as they lie."""
    source = f"{module}.{BLOCKS_SUFFIX}"
    blocks, scales = parts[BLOCKS_SUFFIX], parts.get(SCALES_SUFFIX)
    if scales is None:
        raise QuantizedWeightError(f"mxfp4 weight {source!r} needs {SCALES_SUFFIX}; the checkpoint has {sorted(parts)}")
    half = MXFP4_GROUP // 2
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != half:
        raise QuantizedWeightError(
            f"mxfp4 weight {source!r} is {blocks.dtype} {tuple(blocks.shape)}, "
            f"expected uint8 [O, IN/{MXFP4_GROUP}, {half}]"
        )
    o, groups, _ = blocks.shape
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (o, groups):
        raise QuantizedWeightError(
            f"mxfp4 weight {source!r}: {SCALES_SUFFIX} is {scales.dtype} {tuple(scales.shape)}, "
            f"expected uint8 {(o, groups)}"
        )
    return QuantizedWeight(MXFP4, blocks.reshape(o, groups * half), scales, None, source)
