"""The `gguf-q4_0` expert format: a GGUF file's routed experts in ggml's Q4_0 blocks (32 values in 18 bytes),
kept as the file stores them (plan/expert_formats/gguf_blocks.py; the block's layout: kernels/gguf_blocks.py).
Worker side: services/worker/expert_formats/gguf_q4_0.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_Q4_0 = "gguf-q4_0"


class GgufQ4_0(GgufBlockFormat):
    name = GGUF_Q4_0
    ggml_type = "Q4_0"
    block, block_bytes = 32, 18
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_q4_0:GgufQ4_0Experts"


FORMAT = register(GgufQ4_0())
