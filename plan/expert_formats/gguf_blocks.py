"""What the GGUF expert formats share (one module each: gguf_q8_0.py, gguf_q4_0.py, gguf_q4_1.py, gguf_q5_0.py,
gguf_q5_1.py, gguf_q4_k.py, gguf_q5_k.py, gguf_q6_k.py, gguf_iq4_nl.py, gguf_iq4_xs.py, gguf_mxfp4.py; a GGUF file's
routed experts in one ggml block type, plan/gguf_checkpoint.py): per weight family one byte row of the file's
blocks, unchanged, each row of `cols` values `cols / block` blocks of `block_bytes` (kernels/gguf_blocks.py decodes
them). An expert is priced at exactly the bytes the file stores for it, kept so in host RAM, across PCIe and in the
slots.

This module registers nothing: each type's module subclasses `GgufBlockFormat` with its ggml type and
registers it (the checklist: plan/expert_formats/__init__.py). No torch here."""

from __future__ import annotations

from ferry.plan.expert_formats.registry import ExpertFormat

GGUF_METHOD = "gguf"  # plan/quantization.py's quant_method for a GGUF file's quantized experts


class GgufBlockFormat(ExpertFormat):
    """A GGUF block type as an expert format: `ggml_type` (the file's name for it), `block` values of
    `block_bytes` bytes a block."""

    quantized = True
    # gpt-oss's experts carry biases (ggml-org's files: `ffn_*_exps.bias` in F32): a float32 part of each row, which
    # the twin adds before the clamped SwiGLU (kernels/expert_epilogue.py)
    holds_biases = True
    ggml_type = ""
    block = 0
    block_bytes = 0
    # set per type once its decode is in kernels/gguf_block_decode.py (read by gguf_expert_gemv.py and
    # gguf_expert_gemm.py): a type with only the torch twin (kernels/gguf_blocks.py) is refused on CUDA at boot
    # rather than fail in the first step
    cuda_kernels = False

    @property
    def checkpoint_algos(self) -> tuple[tuple[str, str], ...]:
        return ((GGUF_METHOD, self.ggml_type),)

    def row_parts(self, rows: int, cols: int, part_rows: int):
        if cols % self.block:
            raise ValueError(
                f"{self.name} rows hold whole blocks of {self.block} values: the input size ({cols}) is not a multiple"
            )
        return (("q", "uint8", (rows, cols // self.block * self.block_bytes)),)

    def banks_detail(self, experts: int, bytes_per_slot: int) -> str:
        return (
            f"every routed expert pinned in host RAM as the GGUF file's {self.ggml_type} blocks "
            f"({experts} x {bytes_per_slot} B)"
        )
