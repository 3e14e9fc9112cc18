"""The `gguf-q4_1` expert format: a GGUF file's routed experts in ggml's Q4_1 blocks (32 values in 20 bytes),
kept as the file stores them (plan/expert_formats/gguf_blocks.py; the block's layout: kernels/gguf_blocks.py).
Worker side: services/worker/expert_formats/gguf_q4_1.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_Q4_1 = "gguf-q4_1"


class GgufQ4_1(GgufBlockFormat):
    name = GGUF_Q4_1
    ggml_type = "Q4_1"
    block, block_bytes = 32, 20
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_q4_1:GgufQ4_1Experts"


FORMAT = register(GgufQ4_1())
