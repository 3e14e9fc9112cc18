"""The `gguf-q5_1` expert format: a GGUF file's routed experts in ggml's Q5_1 blocks (32 values in 24 bytes),
kept as the file stores them (plan/expert_formats/gguf_blocks.py; the block's layout: kernels/gguf_blocks.py).
Worker side: services/worker/expert_formats/gguf_q5_1.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_Q5_1 = "gguf-q5_1"


class GgufQ5_1(GgufBlockFormat):
    name = GGUF_Q5_1
    ggml_type = "Q5_1"
    block, block_bytes = 32, 24
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_q5_1:GgufQ5_1Experts"


FORMAT = register(GgufQ5_1())
