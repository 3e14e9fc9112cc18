"""The `gguf-iq4_xs` expert format: a GGUF file's routed experts in ggml's IQ4_XS blocks (256 values in 136 bytes:
IQ4_NL's grid under 6-bit sub-block scales), kept as the file stores them (plan/expert_formats/gguf_blocks.py; the
block's layout: kernels/gguf_blocks.py). Worker side: services/worker/expert_formats/gguf_iq4_xs.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_IQ4_XS = "gguf-iq4_xs"


class GgufIQ4XS(GgufBlockFormat):
    name = GGUF_IQ4_XS
    ggml_type = "IQ4_XS"
    block, block_bytes = 256, 136
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_iq4_xs:GgufIQ4XSExperts"


FORMAT = register(GgufIQ4XS())
