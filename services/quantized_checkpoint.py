"""Writing checkpoints in the published quantized layouts: what `ferry make-bench-model --format` writes,
and how the tests make quantized tiny models (plan/quantization.py reads them back).

* `nvfp4`: nvidia modelopt's NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4`): per quantized
  linear `weight` uint8 [O, IN/2] (two e2m1 codes, element 2j in the low nibble), `weight_scale`
  float8_e4m3fn [O, IN/16], `weight_scale_2` fp32 (= amax / (6 x 448)) and `input_scale` fp32,
  as modelopt computes them: weight ~ e2m1 x weight_scale x weight_scale_2. Quantized: the routed
  and the shared experts (as nvidia's Qwen3.5/3.6 NVFP4 releases); everything else is listed in
  `exclude_modules` and stays bf16.
* `fp8`: Qwen's `-FP8` releases (`quant_method: fp8`, `weight_block_size: [128, 128]`): `weight`
  float8_e4m3fn and `weight_scale_inv` fp32 [ceil(O/128), ceil(IN/128)] (amax / 448 of each block,
  multiplied back), on every linear but the router, the shared expert's gate, the Gated DeltaNet's
  `in_proj_b`/`in_proj_a` and lm_head (`modules_to_not_convert`).

Rounding is round-to-nearest on the e2m1 grid (a tie to the smaller magnitude) and torch's float8
cast. A reader is held to these files by what they say, not by how they were rounded.

torch is imported where tensors are made: `ferry make-bench-model` is a control-plane command and
imports this module before it knows whether it will write weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.plan.expert_formats import E2M1_VALUES

if TYPE_CHECKING:
    import torch

NVFP4, FP8 = "nvfp4", "fp8"
FORMATS = (NVFP4, FP8)
E2M1_MAX, E4M3_MAX = 6.0, 448.0

# Linears that keep bf16 in every format: routers and the shared expert's gate (one row each)
ALWAYS_BF16 = (".mlp.gate.weight", ".shared_expert_gate.weight")
FP8_BF16 = (".in_proj_b.weight", ".in_proj_a.weight", ".in_proj_ba.weight")


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (uint8, sign in bit 3) of every value of x (already scaled into [-6, 6])."""
    import torch

    mag = x.abs().clamp(max=E2M1_MAX)
    code = (mag.unsqueeze(-1) - torch.tensor(E2M1_VALUES, device=x.device)).abs().argmin(dim=-1)
    return (code | torch.where(x < 0, 8, 0)).to(torch.uint8)


def quantize_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear [O, IN] in modelopt's NVFP4 tensors (IN a multiple of 16)."""
    import torch

    w = w.to(torch.float32)
    o, n = w.shape
    if n % 16:
        raise ValueError(f"nvfp4 needs the input size to be a multiple of 16, got {n}")
    amax = w.abs().max().clamp(min=1e-12)
    scale_2 = amax / (E2M1_MAX * E4M3_MAX)
    groups = w.view(o, n // 16, 16)
    block = (groups.abs().amax(-1) / (E2M1_MAX * scale_2)).to(torch.float8_e4m3fn).to(torch.float32)
    block = torch.where(block == 0, 1.0, block).to(torch.float8_e4m3fn)  # an all-zero group: modelopt's 1
    codes = _e2m1_codes(groups / (block.to(torch.float32)[..., None] * scale_2)).view(o, n)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return {
        "weight": packed.contiguous(),
        "weight_scale": block.contiguous(),
        "weight_scale_2": scale_2.reshape(()),
        "input_scale": torch.tensor(1.0 / E4M3_MAX / E2M1_MAX),
    }


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
    """One linear [O, IN] in Qwen's FP8 block tensors (partial blocks at the edges)."""
    import torch

    w = w.to(torch.float32)
    o, n = w.shape
    rb, cb = -(-o // block), -(-n // block)
    padded = torch.zeros(rb * block, cb * block, device=w.device)
    padded[:o, :n] = w
    tiles = padded.view(rb, block, cb, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).view(rb * block, cb * block)[:o, :n].to(torch.float8_e4m3fn)
    return {"weight": q.contiguous(), "weight_scale_inv": scale.contiguous()}


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".weight") and tensor.dim() == 2 and "norm" not in name and "embed_tokens" not in name


def quantized_in(fmt: str, name: str, tensor: torch.Tensor) -> bool:
    """Whether checkpoint tensor `name` is quantized in the layout `fmt` writes."""
    if not is_linear_weight(name, tensor) or name.endswith(ALWAYS_BF16) or name.startswith("lm_head"):
        return False
    if fmt == NVFP4:
        return ".mlp.experts." in name or ".mlp.shared_expert." in name
    return not name.endswith(FP8_BF16)


def quantize_tensors(fmt: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict in checkpoint names -> the same checkpoint in layout `fmt`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not quantized_in(fmt, name, t):
            out[name] = t
            continue
        module = name.removesuffix(".weight")
        parts = quantize_nvfp4(t) if fmt == NVFP4 else quantize_fp8_block(t)
        out.update({f"{module}.{leaf}": v for leaf, v in parts.items()})
    return out


def quantization_config(fmt: str, names: list[str]) -> dict:
    """config.json's `quantization_config` for a checkpoint of these tensor names (before quantizing)."""
    modules = sorted({n.removesuffix(".weight") for n in names if n.endswith(".weight")})
    if fmt == NVFP4:
        kept = [m for m in modules if ".mlp.experts." not in m and ".mlp.shared_expert." not in m]
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": 16,
            "kv_cache_quant_algo": None,
            "exclude_modules": kept,
        }
    if fmt == FP8:
        kept = sorted(
            {m for m in modules if m.startswith("lm_head") or (m + ".weight").endswith((*ALWAYS_BF16, *FP8_BF16))}
        )
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": kept,
        }
    raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
