"""The `gguf-iq4_nl` expert format: a GGUF file's routed experts in ggml's IQ4_NL blocks (32 values in 18 bytes:
indices into a non-linear grid under one fp16 scale), kept as the file stores them
(plan/expert_formats/gguf_blocks.py; the block's layout: kernels/gguf_blocks.py). Worker side:
services/worker/expert_formats/gguf_iq4_nl.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_IQ4_NL = "gguf-iq4_nl"


class GgufIQ4NL(GgufBlockFormat):
    name = GGUF_IQ4_NL
    ggml_type = "IQ4_NL"
    block, block_bytes = 32, 18
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_iq4_nl:GgufIQ4NLExperts"


FORMAT = register(GgufIQ4NL())
