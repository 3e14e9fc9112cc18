"""The `nvfp4` expert format (nvidia modelopt and compressed-tensors NVFP4 checkpoints): per weight
family one byte row of the e2m1 codes uint8 [O, IN/2] (element 2j in the low nibble), the
float8_e4m3fn scales [O, IN/16] of every 16 inputs, and a float32 scale per row (the projection's
per-tensor scale, one per row because w13 stacks gate and up, whose scales differ): ~1.69 I H bytes
an expert. Kept so in host RAM, across PCIe and in the slots; the kernels dequantize in registers.
Worker side: services/worker/expert_formats/nvfp4.py.

It registers what every format must (the checklist: plan/expert_formats/__init__.py): its name, its
byte row (`row_parts`), the checkpoint quantization it holds (`checkpoint_algos`), the layout
make-bench-model writes (`checkpoint_layout`, `checkpoint_quantizes`, `checkpoint_config`) and its
worker class."""

from __future__ import annotations

from ferry.plan.expert_formats.registry import CHECKPOINT_BF16_LINEARS, ExpertFormat, register

NVFP4 = "nvfp4"
NVFP4_GROUP = 16  # inputs per float8 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes by code (bits 0-2; bit 3 is the sign)
# the linears a checkpoint written in this layout quantizes: every MLP linear but the routers (registry's
# CHECKPOINT_BF16_LINEARS): the routed and shared experts (nvidia's Qwen3.5/3.6 NVFP4 releases, which have no
# dense MLP) and a dense layer's MLP (GLM-4.5's first layers, whose NVFP4 releases quantize them and their
# shared experts: FreeToken 0.1.2 reads no other); attention, embeddings and lm_head stay bf16 (exclude_modules)
CHECKPOINT_QUANTIZED = (".mlp.",)


class Nvfp4(ExpertFormat):
    name = NVFP4
    quantized = True
    holds_biases = True  # a float32 bias part in each row (registry.BIAS_PART); the fp4 kernels add it
    checkpoint_algos = (("modelopt", "NVFP4"), ("compressed-tensors", "nvfp4-pack-quantized"))
    checkpoint_layout = NVFP4  # nvidia modelopt's NVFP4 (services/quantized_checkpoint.py)
    worker = "ferry.services.worker.expert_formats.nvfp4:Nvfp4Experts"

    def row_parts(self, rows: int, cols: int, part_rows: int):
        if cols % NVFP4_GROUP:
            raise ValueError(f"nvfp4 needs the input size ({cols}) to be a multiple of {NVFP4_GROUP}")
        return (
            ("q", "uint8", (rows, cols // 2)),
            ("scale", "float8_e4m3fn", (rows, cols // NVFP4_GROUP)),
            ("gscale", "float32", (rows,)),
        )

    def checkpoint_quantizes(self, name: str) -> bool:
        module = name.removesuffix(".weight")  # a module's name (exclude_modules) or its weight's
        return any(part in module for part in CHECKPOINT_QUANTIZED) and not f"{module}.weight".endswith(
            CHECKPOINT_BF16_LINEARS
        )

    def checkpoint_config(self, modules: list[str]) -> dict:
        return {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": NVFP4_GROUP,
            "kv_cache_quant_algo": None,
            "exclude_modules": [m for m in modules if not self.checkpoint_quantizes(m)],
        }


FORMAT = register(Nvfp4())
