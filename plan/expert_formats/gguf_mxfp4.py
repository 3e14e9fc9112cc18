"""The `gguf-mxfp4` expert format: a GGUF file's routed experts in ggml's MXFP4 blocks (32 values in 17 bytes: an
e8m0 scale byte, then 16 bytes of e2m1 codes), kept as the file stores them (plan/expert_formats/gguf_blocks.py;
the block's layout: kernels/gguf_blocks.py). Not the `mxfp4` format: that one keeps a checkpoint's codes and
scales as two parts of a row, this one the file's interleaved blocks. gpt-oss's experts (ggml-org's files) come
in it, their biases in a float32 part of each row (gguf_blocks.py's `holds_biases`).
Worker side: services/worker/expert_formats/gguf_mxfp4.py."""

from __future__ import annotations

from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
from ferry.plan.expert_formats.registry import register

GGUF_MXFP4 = "gguf-mxfp4"


class GgufMxfp4(GgufBlockFormat):
    name = GGUF_MXFP4
    ggml_type = "MXFP4"
    block, block_bytes = 32, 17
    cuda_kernels = True  # kernels/gguf_expert_gemv.py, gguf_expert_gemm.py (decode: gguf_block_decode.py)
    worker = "ferry.services.worker.expert_formats.gguf_mxfp4:GgufMxfp4Experts"


FORMAT = register(GgufMxfp4())
