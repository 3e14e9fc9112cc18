"""The `gguf-q4_k` expert format: a GGUF file's routed experts in ggml's Q4_K blocks (256 values in 144 bytes),
kept as the file stores them (plan/expert_formats/gguf_blocks.py; the block's layout: kernels/gguf_blocks.py).
Worker side: services/worker/expert_formats/gguf_q4_k.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_Q4_K = "gguf-q4_k"


class GgufQ4K(GgufBlockFormat):
    name = GGUF_Q4_K
    ggml_type = "Q4_K"
    block, block_bytes = 256, 144
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_q4_k:GgufQ4KExperts"


FORMAT = register(GgufQ4K())
