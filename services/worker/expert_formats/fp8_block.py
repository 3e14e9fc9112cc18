"""The `fp8-block` expert format's worker side (Qwen's `-FP8` checkpoints: float8_e4m3fn with 128 x 128
block scales; plan/expert_formats/fp8_block.py prices its rows and recognizes the checkpoints).

Per weight family the byte row holds (plan/expert_formats/fp8_block.py) the float8_e4m3fn weights [O, IN]
and the float32 scales of every 128 x 128 block of each projection (w13's gate and up keep their
own block rows, restarting at row I, since partial blocks occur), as the checkpoints' scale_inv
multiplies. Per-tensor FP8 experts (modelopt FP8) are held the same way, their one scale in every
block. The kernels dequantize in registers and compute in the activations' dtype (W8A16, not W8A8:
decode reads each weight once a token, so FP8 tensor cores would not be its bottleneck, and bf16
activations keep the accuracy of the checkpoint's own dequantized weights): kernels/quantized_expert_gemm.py
and kernels/quantized_expert_gemv.py read the views `gemm_views` gives (kernels/quantized_experts.py).
Here too: the host reader's decode of its rows (Fp8BlockFamilyReader), the host kernel's code, the dummy
weights of `--load-format dummy`, and Qwen's FP8 tensors of one linear (`quantize_linear`, what
`ferry make-bench-model --format fp8` writes).

What every quantized worker format gives (the checklist: services/worker/expert_formats/__init__.py):
`plan` and `name`, `_write` and `_fill_dummy` of its parts, `host_kernel_code`, `family_reader`, and
`quantize_linear` where make-bench-model writes its layout."""

from __future__ import annotations

import torch

from ferry.kernels.quantized_experts import FP8_BLOCK_SIZE, QuantizedFamily, ceil_div, row_block_index
from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats.quantized import (
    E4M3_MAX,
    QuantizedExperts,
    dummy_pattern,
    expert_windows,
    fill_bytes_of,
    part,
    raw,
)
from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute import host_expert_weights as W
from ferry.services.worker.quantized_weight import FP8_BLOCK, FP8_TENSOR, QuantizedWeight


def quantize_linear(w: torch.Tensor, block: int = FP8_BLOCK_SIZE) -> dict[str, torch.Tensor]:
    """One linear [O, IN] in Qwen's FP8 block tensors (partial blocks at the edges): `weight` float8_e4m3fn
    and `weight_scale_inv` fp32 [ceil(O/128), ceil(IN/128)] (amax / 448 of each block, multiplied back)."""
    w = w.to(torch.float32)
    o, n = w.shape
    rb, cb = -(-o // block), -(-n // block)
    padded = torch.zeros(rb * block, cb * block, device=w.device)
    padded[:o, :n] = w
    tiles = padded.view(rb, block, cb, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).view(rb * block, cb * block)[:o, :n].to(torch.float8_e4m3fn)
    return {"weight": q.contiguous(), "weight_scale_inv": scale.contiguous()}


class Fp8BlockFamilyReader(W.QuantizedFamilyReader):
    """The host reader of one fp8-block family: the weights as float16 bits, times each row's block scales
    (host_expert_weights.py's decoders, read through the module: one place to test them)."""

    def __init__(self, family: QuantizedFamily, dtype: torch.dtype, chunk: int = W.DECODE_CHUNK):
        super().__init__(family, dtype, chunk)
        self.scale_rows = row_block_index(family.rows, family.part_rows)  # each row's block row of scales
        # a partial block at the edge: its own op
        self.full_cols = family.cols // FP8_BLOCK_SIZE * FP8_BLOCK_SIZE

    def decode_rows(self, f: QuantizedFamily, expert: int, r0: int, r1: int, stage: torch.Tensor) -> None:
        n = r1 - r0
        stage.copy_(W.e4m3_as_fp16(f.q[expert, r0:r1], self.codes[:n]))
        scales = f.scale[expert].index_select(0, self.scale_rows[r0:r1]).mul_(W.E4M3_IN_FP16)  # [n, column blocks]
        full = self.full_cols // FP8_BLOCK_SIZE
        if full:
            stage[:, : self.full_cols].view(n, full, FP8_BLOCK_SIZE).mul_(scales[:, :full, None])
        if self.full_cols < f.cols:
            stage[:, self.full_cols :].mul_(scales[:, full:])


class Fp8BlockExperts(QuantizedExperts):
    plan = F.get(F.FP8_BLOCK)
    name = plan.name
    host_kernel_code = K.FP8_BLOCK
    family_reader = Fp8BlockFamilyReader
    quantize_linear = staticmethod(quantize_linear)

    def _write(self, row: torch.Tensor, layout: F.FamilyLayout, projections: tuple[QuantizedWeight, ...]) -> None:
        q, scale = (part(row, p) for p in layout.parts)
        blocks = ceil_div(layout.part_rows, FP8_BLOCK_SIZE)
        for n, proj in enumerate(projections):
            first = n * layout.part_rows
            q[first : first + layout.part_rows].copy_(proj.q)
            mine = scale[n * blocks : (n + 1) * blocks]
            if proj.fmt == FP8_BLOCK:
                mine.copy_(proj.scale)
            elif proj.fmt == FP8_TENSOR:
                mine.copy_(proj.scale.expand_as(mine))
            else:
                raise ValueError(
                    f"checkpoint tensor {proj.source!r} is {proj.fmt}, but the routed experts are fp8 "
                    "(config.json's quantization_config): every expert must be fp8"
                )

    def _fill_dummy(self, rows: torch.Tensor, layout: F.FamilyLayout, std: float, gen: torch.Generator) -> None:
        """Normal float8 weights (no NaN: they are cast, not drawn as bytes) under block scales of `std`."""
        q, scale = layout.parts
        experts, width = rows.shape[0], q.nbytes
        pattern = torch.randn(dummy_pattern(experts, width), generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
        raw(rows, q).copy_(expert_windows(pattern, experts, width))
        fill_bytes_of(rows, scale, std)
