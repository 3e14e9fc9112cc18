"""The `gguf-q5_k` expert format: a GGUF file's routed experts in ggml's Q5_K blocks (256 values in 176 bytes),
kept as the file stores them (plan/expert_formats/gguf_blocks.py; the block's layout: kernels/gguf_blocks.py).
Worker side: services/worker/expert_formats/gguf_q5_k.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_Q5_K = "gguf-q5_k"


class GgufQ5K(GgufBlockFormat):
    name = GGUF_Q5_K
    ggml_type = "Q5_K"
    block, block_bytes = 256, 176
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_q5_k:GgufQ5KExperts"


FORMAT = register(GgufQ5K())
