"""Tiny checkpoints in the published quantized layouts, and the reference they are held to.

`quantize_tiny(src, out, layout)` rewrites a tiny checkpoint (services/make_tiny_model.py) with its
MLP linears but the routers (modelopt nvfp4: routed and shared experts, a dense layer's MLP), its routed and
shared experts (compressed-tensors nvfp4) or every linear but the router-like ones (fp8) quantized:

* `modelopt-nvfp4`: Ferry's own writer (services/quantized_checkpoint.py), nvidia modelopt's names;
* `ct-nvfp4`: quantized and packed by the compressed-tensors package itself (its NVFP4A16 scheme,
  its scales, its global scale, its packing), in its `nvfp4-pack-quantized` layout and config;
* `fp8`: Ferry's own writer, Qwen's FP8 block layout (128 x 128; the tiny models' blocks are partial);
* `mxfp4`: Ferry's own writer, gpt-oss's MXFP4 (`quant_method: mxfp4`, e2m1 blocks under e8m0 scales of
  32 inputs) per linear (`weight_blocks`, `weight_scales`), the routed experts only.

`dequantized_copy(quantized, out, layout)` is the reference nobody here wrote the convention of: the
same checkpoint dequantized back to float32 (compressed-tensors' own `decompress` for its layout,
transformers' own gpt-oss dequantizer for mxfp4; for modelopt and fp8, a numpy transcription of their
definitions, checked against compressed-tensors' fp4 unpacking in the tests), saved without a
quantization_config, so transformers loads it as a plain model. `corrupt` makes the deliberate mistakes
the tests must catch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ferry.services.quantized_checkpoint import quantization_config, quantize_tensors

LAYOUTS = ("modelopt-nvfp4", "ct-nvfp4", "fp8", "mxfp4")
# the expert format each layout's routed experts are held in
LAYOUT_FORMATS = {"modelopt-nvfp4": "nvfp4", "ct-nvfp4": "nvfp4", "fp8": "fp8-block", "mxfp4": "mxfp4"}
# ferry make-bench-model's --format word for the layouts Ferry writes itself
WRITER_FORMATS = {"modelopt-nvfp4": "nvfp4", "fp8": "fp8", "mxfp4": "mxfp4"}
# e2m1 by code, sign in bit 3 (the OCP microscaling spec's table, as modelopt and compressed-tensors list it)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _copy_dir(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)


def _ct_nvfp4(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    out, ignored = {}, []
    for name, w in tensors.items():
        quantized = name.endswith(".weight") and (".mlp.experts." in name or ".mlp.shared_expert." in name)
        if not quantized:
            out[name] = w
            if name.endswith(".weight") and w.dim() == 2:
                ignored.append(name.removesuffix(".weight"))
            continue
        w = w.to(torch.float32)
        o, n = w.shape
        gs = generate_gparam(w.min(), w.max())
        groups = w.view(o, n // 16, 16)
        scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
        sd = NVFP4PackedCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_global_scale": gs, "weight_zero_point": zp}, scheme
        )
        module = name.removesuffix(".weight")
        out.update({f"{module}.{k}": v for k, v in sd.items()})
    config = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": "nvfp4-pack-quantized",
                "weights": scheme.weights.model_dump(),
                "input_activations": None,
            }
        },
        "ignore": sorted(ignored),
    }
    return out, config


def quantize_tiny(src: Path, out: Path, layout: str) -> Path:
    """A quantized copy of the tiny checkpoint `src` in `layout`."""
    _copy_dir(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    if layout == "ct-nvfp4":
        quantized, qc = _ct_nvfp4(tensors)
    else:
        fmt = WRITER_FORMATS[layout]
        quantized, qc = quantize_tensors(fmt, tensors), quantization_config(fmt, list(tensors))
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy() if t.dtype != torch.uint8 else t.numpy()


def dequantize_module(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One linear's float32 weight from its checkpoint parts, by the formats' own definitions."""
    if "weight_blocks" in parts:  # mxfp4: transformers' own gpt-oss dequantizer ([E, O, G, 16] -> [E, IN, O])
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        blocks, scales = parts["weight_blocks"][None], parts["weight_scales"][None]
        return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[0].T.contiguous()
    if "weight_packed" in parts:  # compressed-tensors: its own decompression
        from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
        from compressed_tensors.quantization import QuantizationScheme
        from compressed_tensors.quantization.quant_scheme import NVFP4A16

        scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
        return NVFP4PackedCompressor.decompress(dict(parts), scheme)["weight"].to(torch.float32)
    w = parts["weight"]
    if w.dtype == torch.uint8:  # modelopt NVFP4: e2m1(code) * weight_scale (per 16) * weight_scale_2
        b = w.numpy()
        codes = np.empty((b.shape[0], b.shape[1] * 2), dtype=np.uint8)
        codes[:, 0::2], codes[:, 1::2] = b & 0x0F, b >> 4
        scale = np.repeat(_np(parts["weight_scale"]), 16, axis=1)
        return torch.from_numpy(E2M1[codes] * scale * float(parts["weight_scale_2"]))
    q = _np(w)  # fp8 block: weight * weight_scale_inv of its 128 x 128 block
    inv = _np(parts["weight_scale_inv"])
    full = np.kron(inv, np.ones((128, 128), dtype=np.float32))[: q.shape[0], : q.shape[1]]
    return torch.from_numpy(q * full)


def dequantized_copy(quantized: Path, out: Path) -> Path:
    """The quantized checkpoint dequantized to float32, without a quantization_config."""
    _copy_dir(quantized, out)
    tensors = load_file(str(quantized / "model.safetensors"))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    plain = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        quant_leaves = ("weight_scale", "weight_scale_2", "weight_scale_inv", "weight_global_scale", "input_scale")
        if leaf in (*quant_leaves, "weight_blocks", "weight_scales"):
            modules.setdefault(module, {})[leaf] = t
        elif leaf in ("weight", "weight_packed") and t.dtype in (torch.uint8, torch.float8_e4m3fn):
            modules.setdefault(module, {})[leaf] = t
        else:
            plain[name] = t
    for module, parts in modules.items():
        plain[f"{module}.weight"] = dequantize_module(parts)
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def corrupt(quantized: Path, out: Path, mistake: str) -> Path:
    """The checkpoint with one deliberate mistake in its experts: `nibbles` (codes swapped within each
    byte) or `scale` (the per-tensor or block scales inverted: dividing where the format multiplies;
    mxfp4's e8m0 bytes one up, as a reader with bias 126 would take them).
    (The tiny models' fp8 weights are one partial block each: a wrong block layout is caught on larger
    shapes, by the kernel and loader tests.)"""
    _copy_dir(quantized, out)
    tensors = load_file(str(quantized / "model.safetensors"))
    for name, t in list(tensors.items()):
        if ".mlp.experts." not in name:
            continue
        codes = (".weight", ".weight_packed", ".weight_blocks")
        if mistake == "nibbles" and name.endswith(codes) and t.dtype == torch.uint8:
            tensors[name] = (t >> 4) | ((t & 0x0F) << 4)
        elif mistake == "scale" and name.endswith((".weight_scale_2", ".weight_global_scale", ".weight_scale_inv")):
            tensors[name] = 1.0 / t
        elif mistake == "scale" and name.endswith(".weight_scales"):
            tensors[name] = t + 1
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
