"""The `mxfp4` expert format (OCP microscaling FP4, as openai's gpt-oss publishes it: `quant_method: mxfp4`):
per weight family one byte row of the e2m1 codes uint8 [O, IN/2] (element 2j in the low nibble) and
the e8m0 scales uint8 [O, IN/32] of every 32 inputs (a scale byte s is 2^(s - 127)); no per-tensor
scale: ~1.59 I H bytes an expert. Kept so in host RAM, across PCIe and in the slots; the kernels
dequantize in registers (the NVFP4 kernels' body, with the scale kind and group size as parameters).
Worker side: services/worker/expert_formats/mxfp4.py.

The published tensors (gpt-oss: `*_blocks` uint8 [E, O, IN/32, 16], `*_scales` uint8 [E, O, IN/32])
are per linear `weight_blocks` [O, IN/32, 16] and `weight_scales` [O, IN/32] here (what
`ferry make-bench-model --format mxfp4` writes; services/worker/quantized_weight.py reads them):
the blocks' bytes are the row's codes as they lie.

It registers what every format must (the checklist: plan/expert_formats/__init__.py): its name, its
byte row (`row_parts`), the checkpoint quantization it holds (`checkpoint_algos`), the layout
make-bench-model writes (`checkpoint_layout`, `checkpoint_quantizes`, `checkpoint_config`) and its
worker class."""

from __future__ import annotations

from ferry.plan.expert_formats.registry import ExpertFormat, register

MXFP4 = "mxfp4"
MXFP4_METHOD = MXFP4  # quantization_config's quant_method (it names no algorithm: the method is the scheme)
MXFP4_GROUP = 32  # inputs per e8m0 scale
E8M0_BIAS = 127  # a scale byte s is 2^(s - 127)
# the checkpoint tensors of one quantized linear (gpt-oss's `*_blocks` / `*_scales`, per linear)
BLOCKS_SUFFIX, SCALES_SUFFIX = "weight_blocks", "weight_scales"
# the linears a checkpoint written in this layout quantizes: the routed experts (as gpt-oss); everything
# else stays bf16 (modules_to_not_convert)
CHECKPOINT_QUANTIZED = (".mlp.experts.",)


class Mxfp4(ExpertFormat):
    name = MXFP4
    quantized = True
    holds_biases = True  # a float32 bias part in each row (registry.BIAS_PART); the fp4 kernels add it
    checkpoint_algos = ((MXFP4_METHOD, MXFP4_METHOD),)
    checkpoint_layout = MXFP4  # gpt-oss's MXFP4, per linear (services/quantized_checkpoint.py)
    worker = "ferry.services.worker.expert_formats.mxfp4:Mxfp4Experts"

    def row_parts(self, rows: int, cols: int, part_rows: int):
        if cols % MXFP4_GROUP:
            raise ValueError(f"mxfp4 needs the input size ({cols}) to be a multiple of {MXFP4_GROUP}")
        return (
            ("q", "uint8", (rows, cols // 2)),
            ("scale", "uint8", (rows, cols // MXFP4_GROUP)),
        )

    def checkpoint_quantizes(self, name: str) -> bool:
        return any(part in name for part in CHECKPOINT_QUANTIZED)

    def checkpoint_config(self, modules: list[str]) -> dict:
        return {
            "quant_method": MXFP4_METHOD,
            "modules_to_not_convert": [m for m in modules if not self.checkpoint_quantizes(m)],
        }


FORMAT = register(Mxfp4())
