"""The `fp8-block` expert format (Qwen's `-FP8` checkpoints: float8_e4m3fn with 128 x 128 block scales;
modelopt's per-tensor FP8 experts are held the same way, their one scale in every block): per weight
family one byte row of the float8_e4m3fn weights [O, IN] and the float32 scales of every 128 x 128
block of each projection (w13's gate and up keep their own block rows): ~3 I H bytes an expert. Kept
so in host RAM, across PCIe and in the slots; the kernels dequantize in registers.
Worker side: services/worker/expert_formats/fp8_block.py.

It registers what every format must (the checklist: plan/expert_formats/__init__.py): its name, its
byte row (`row_parts`), the checkpoint quantization it holds (`checkpoint_algos`), the layout
make-bench-model writes (`checkpoint_layout`, `checkpoint_quantizes`, `checkpoint_config`) and its
worker class."""

from __future__ import annotations

from ferry.plan.expert_formats.registry import CHECKPOINT_BF16_LINEARS, ExpertFormat, register
from ferry.shared.units import ceil_div

FP8_BLOCK = "fp8-block"
FP8_BLOCK_SIZE = 128  # rows and columns per float32 scale
# the quant_algo Ferry names the `fp8` quant_method's one scheme (e4m3 weights under 128 x 128 block scales)
FP8_BLOCKS = "e4m3 128x128"
# linears a checkpoint written in this layout keeps bf16 besides CHECKPOINT_BF16_LINEARS and lm_head:
# the Gated DeltaNet's in_proj_b / in_proj_a (Qwen's releases list them in modules_to_not_convert)
CHECKPOINT_BF16 = (".in_proj_b.weight", ".in_proj_a.weight", ".in_proj_ba.weight")


class Fp8Block(ExpertFormat):
    name = FP8_BLOCK
    quantized = True
    checkpoint_algos = (("modelopt", "FP8"), ("fp8", FP8_BLOCKS))
    checkpoint_layout = "fp8"  # Qwen's FP8 block layout (services/quantized_checkpoint.py)
    worker = "ferry.services.worker.expert_formats.fp8_block:Fp8BlockExperts"

    def row_parts(self, rows: int, cols: int, part_rows: int):
        row_blocks = (rows // part_rows) * ceil_div(part_rows, FP8_BLOCK_SIZE)
        return (
            ("q", "float8_e4m3fn", (rows, cols)),
            ("scale", "float32", (row_blocks, ceil_div(cols, FP8_BLOCK_SIZE))),
        )

    def checkpoint_quantizes(self, name: str) -> bool:
        return not name.endswith(CHECKPOINT_BF16)

    def checkpoint_config(self, modules: list[str]) -> dict:
        bf16 = (*CHECKPOINT_BF16_LINEARS, *CHECKPOINT_BF16)
        kept = sorted({m for m in modules if m.startswith("lm_head") or (m + ".weight").endswith(bf16)})
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK_SIZE, FP8_BLOCK_SIZE],
            "modules_to_not_convert": kept,
        }


FORMAT = register(Fp8Block())
