"""The `gguf-q6_k` expert format: a GGUF file's routed experts in ggml's Q6_K blocks (256 values in 210 bytes),
kept as the file stores them (plan/expert_formats/gguf_blocks.py; the block's layout: kernels/gguf_blocks.py).
Worker side: services/worker/expert_formats/gguf_q6_k.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_Q6_K = "gguf-q6_k"


class GgufQ6K(GgufBlockFormat):
    name = GGUF_Q6_K
    ggml_type = "Q6_K"
    block, block_bytes = 256, 210
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_q6_k:GgufQ6KExperts"


FORMAT = register(GgufQ6K())
