"""The `gguf-q8_0` expert format: a GGUF file's routed experts in ggml's Q8_0 blocks (32 values in 34 bytes),
kept as the file stores them (plan/expert_formats/gguf_blocks.py; the block's layout: kernels/gguf_blocks.py).
Worker side: services/worker/expert_formats/gguf_q8_0.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_Q8_0 = "gguf-q8_0"


class GgufQ8_0(GgufBlockFormat):
    name = GGUF_Q8_0
    ggml_type = "Q8_0"
    block, block_bytes = 32, 34
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_q8_0:GgufQ8_0Experts"


FORMAT = register(GgufQ8_0())
