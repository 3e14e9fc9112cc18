"""Fixed byte costs of a model on the GPU: resident weights and the activation workspace.

`ferry plan` uses these; the worker replaces both with measurements at boot (docs/ARCHITECTURE.md §2 rule 3).
No torch here.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from ferry.plan.dtypes import DTYPE_BYTES
from ferry.plan.model_families import family_of
from ferry.plan.model_spec import ModelSpec
from ferry.plan.quantization import DROPPED_SUFFIXES, SCALE_SUFFIXES, WEIGHT_SUFFIXES
from ferry.shared.errors import ModelLoadError
from ferry.shared.units import ceil_div, round_up

# The CUDA caching allocator hands out blocks in multiples of 512 bytes.
ALLOC_GRANULE = 512

# A step's token mixers (attention, Gated DeltaNet) run over slices of at most this many of its new
# tokens, one after another; its MoE layers over all of them at once (services/worker/mixer_slices.py).
# A mixer's GEMMs already run at their rate on 8,192 rows and its intermediates grow with the rows (the
# Gated DeltaNet's float32 q, k, v and chunk states: 1.1 GiB at 8,192 tokens of Qwen3.6-35B-A3B), while a
# MoE layer's cost with experts offloaded is per step (one pass over the experts without a slot). So a
# longer step streams less per prompt token for little more workspace than an 8,192-token one.
MIXER_SLICE_TOKENS = 8192

# The expert stores compute each (token, k) pair's output into a row of a [T, k, H] buffer that is summed
# over k (kernels/expert_rows_sum.py). A step of up to this many tokens keeps the rows in float32, every
# bit of each pair; a longer step writes them in the model's dtype, each row rounded once: at 16,384 tokens
# of Qwen3.6-35B-A3B float32 rows are 1.07 GB, 0.54 GB more than an 8,192-token step's, ~86 of the 35B's
# 6.29 MB expert slots. transformers itself rounds each pair's output to the dtype and adds them there.
ROWS_FLOAT32_MAX_TOKENS = 8192

SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


# a multimodal wrapper's towers and their embedders beside the text model (Gemma 4's), never served
UNSERVED_TOWERS = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# a layer's routed experts: `layers.N.mlp.experts…`, or `layers.N.experts…` beside the layer's dense MLP (Gemma 4)
_ROUTED_EXPERTS = re.compile(r"(?:^|\.)layers\.\d+\.(?:mlp\.)?experts(?:\.|$)")


def is_routed_expert(name: str) -> bool:
    """Routed experts live in host banks, not among the GPU-resident weights."""
    return _ROUTED_EXPERTS.search(name) is not None


def is_served(name: str, spec: ModelSpec | None = None) -> bool:
    """Tensors of a checkpoint that the text model uses: vision towers and MTP heads are not served, nor
    (given the spec) the `spec.mtp_layers` multi-token-prediction layers stored after the decoder's."""
    if name.startswith(("visual.", "model.visual.", "mtp.", "model.mtp.")) or ".visual." in name:
        return False
    if any(f"{tower}." in name for tower in UNSERVED_TOWERS):
        return False
    if spec is None or not spec.mtp_layers:
        return True
    m = _LAYER.search(name)
    return m is None or not spec.num_layers <= int(m[1]) < spec.num_layers + spec.mtp_layers


def resident_weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every GPU-resident parameter of the text model (routed experts excluded), by checkpoint name: as its
    family lays it out (plan/model_families/)."""
    return family_of(spec).resident_weight_shapes(spec)


def _tensor_bytes(numel: int, itemsize: int) -> int:
    return round_up(numel * itemsize, ALLOC_GRANULE)


# parameters the worker keeps in float32 whatever the run dtype: the sigmoid router's choosing bias (it decides
# between close scores: services/worker/layers/mlp.py) and the Gated DeltaNet's decay (layers/gated_deltanet.py)
FLOAT32_PARAMETERS = (".e_score_correction_bias", ".A_log", ".dt_bias")


def parameter_itemsize(name: str, dtype: str) -> int:
    """Bytes a value of parameter `name` takes on the GPU when the model runs in `dtype`."""
    return DTYPE_BYTES["float32"] if name.endswith(FLOAT32_PARAMETERS) else DTYPE_BYTES[dtype]


def shapes_bytes(shapes: dict[str, tuple[int, ...]], dtype: str) -> int:
    """GPU bytes of parameters {name: shape}, one allocation each, as the worker allocates them."""
    total = 0
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        total += _tensor_bytes(numel, parameter_itemsize(name, dtype))
    return total


def resident_weight_bytes_from_shapes(spec: ModelSpec, dtype: str) -> int:
    return shapes_bytes(resident_weight_shapes(spec), dtype)


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The JSON header of one .safetensors file: {name: {dtype, shape, data_offsets}}."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read the safetensors header of {path}: {exc}") from exc
    header.pop("__metadata__", None)
    return header


# The scales and packed codes of quantized checkpoints (plan/quantization.py). Their dense weights
# are dequantized once at load (services/worker/quantized_weight.py): the scales are not kept, and a
# quantized weight takes its dequantized size in the run dtype.
QUANT_SCALE_SUFFIXES = tuple("." + s for s in (*SCALE_SUFFIXES, *DROPPED_SUFFIXES))
_CODE_SUFFIXES = tuple("." + s for s in WEIGHT_SUFFIXES)  # a uint8 one holds nvfp4 codes, two a byte


def resident_weight_bytes_from_checkpoint(model_dir: Path, dtype: str, spec: ModelSpec | None = None) -> int | None:
    """Exact resident bytes from the checkpoint's safetensors headers; None when there are none.

    Floating-point tensors are counted at the run dtype (they are converted on load); so are
    quantized ones (uint8 nvfp4 codes hold two values a byte, float8 one), which are dequantized
    on load, and their scales are not kept."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if is_routed_expert(name) or not is_served(name, spec) or name.endswith(QUANT_SCALE_SUFFIXES):
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            kind = info["dtype"]
            if kind == "U8" and name.endswith(_CODE_SUFFIXES):  # nvfp4 codes
                kind, numel = "BF16", 2 * numel
            elif kind in ("F8_E4M3", "F8_E5M2"):
                kind = "BF16"
            itemsize = (
                parameter_itemsize(name, dtype) if kind in _FLOAT_DTYPES else SAFETENSORS_DTYPE_BYTES.get(kind, 1)
            )
            total += _tensor_bytes(numel, itemsize)
    return total


def rows_value_bytes(step_tokens: int, dtype_bytes: int) -> int:
    """Bytes of one value of the expert stores' row buffer in a step of `step_tokens` tokens."""
    return 4 if step_tokens <= ROWS_FLOAT32_MAX_TOKENS else dtype_bytes


def widest_rows_bytes(spec: ModelSpec, dtype: str, max_step_tokens: int) -> int:
    """The largest row buffer [T, k, H] of any step of up to `max_step_tokens` tokens: past
    ROWS_FLOAT32_MAX_TOKENS the longest step's rows in the dtype can hold less than the float32 rows of a
    step of exactly that many tokens (9,000 bf16 rows against 8,192 float32 ones), which may run too."""
    row = spec.num_experts_per_tok * spec.hidden_size
    b = DTYPE_BYTES[dtype]
    widest = max_step_tokens * row * rows_value_bytes(max_step_tokens, b)
    if max_step_tokens > ROWS_FLOAT32_MAX_TOKENS:
        widest = max(widest, ROWS_FLOAT32_MAX_TOKENS * row * 4)
    return widest


def rows_beyond_longest_step(spec: ModelSpec, dtype: str, max_step_tokens: int) -> int:
    """What the widest row buffer holds beyond the longest step's own: the boot profile runs only the
    longest step, so it adds this (0 but where the longest step's rows are in the dtype and narrower)."""
    own = max_step_tokens * spec.num_experts_per_tok * spec.hidden_size
    return widest_rows_bytes(spec, dtype, max_step_tokens) - own * rows_value_bytes(max_step_tokens, DTYPE_BYTES[dtype])


def workspace_bytes_estimate(
    spec: ModelSpec,
    dtype: str,
    max_step_tokens: int,
    max_running_requests: int,
    max_model_len: int,
    mixer_slice_tokens: int = MIXER_SLICE_TOKENS,
) -> int:
    """Activation memory of the largest step, estimated from shapes (the worker profiles it instead).

    Counts what is live at once in the widest layer: the residual stream and its norm, the
    attention projections and one layer's K/V context gathered from the pages, the MoE gather/GEMM buffers
    (the row buffer of the expert stores included: `widest_rows_bytes`) and
    router scores, the Gated DeltaNet projections and per-chunk states, and fp32 logits and
    probabilities of every sampled row, the sampler state of every penalised request. The token
    mixers' terms are those of one slice (`mixer_slice_tokens`), the MoE's and the residual stream's
    of the whole step. A 25% margin covers allocator fragmentation."""
    b = DTYPE_BYTES[dtype]
    t, h = max_step_tokens, spec.hidden_size
    residual = 4 * t * h * b
    nh, tm = spec.num_attention_heads, min(t, mixer_slice_tokens)
    attention = 0
    for kvh, hd in {(spec.layer_kv_heads(i), spec.layer_head_dim(i)) for i in spec.full_attention_layers}:
        shaped = tm * (nh * hd * (3 if spec.attn_output_gate else 2) + 2 * kvh * hd) * b
        shaped += 2 * max_model_len * kvh * hd * b  # one layer's K/V context gathered from its pages
        attention = max(attention, shaped)
    k, i = spec.num_experts_per_tok, spec.moe_intermediate_size
    # both expert stores: [T, k, H] rows summed over k (fp32 [T, H]; the rows in float32 up to
    # ROWS_FLOAT32_MAX_TOKENS, in the dtype past it: the widest of any step up to t), the pairs' gate/up and
    # activation, gathered inputs (reference path); router scores and top-k ids/weights. The offload
    # store's extra (slot maps, alignment) is added by store_plan.py when the plan offloads.
    moe = (
        widest_rows_bytes(spec, dtype, t) + t * h * 4 + t * k * (3 * i + h) * b + t * spec.num_experts * 4 + t * k * 12
    )
    if spec.shared_expert_intermediate_size:
        moe += t * 3 * spec.shared_expert_intermediate_size * b
    dense = t * 3 * spec.intermediate_size * b if not all(spec.moe_layers) else 0
    if spec.moe_beside_dense_mlp:  # the dense MLP's activations, then its normed output beside the experts'
        moe += t * (3 * spec.intermediate_size + 2 * h) * b
    linear = 0
    if spec.linear_attention_layers:
        nv, dk, dv = spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
        linear = 2 * tm * (spec.linear_conv_dim + spec.linear_value_dim + 2 * nv) * b
        linear += 3 * tm * spec.linear_conv_dim * 4  # fp32 q, k, v inside the delta rule
        linear += ceil_div(tm, 64) * nv * dk * dv * 4  # per-chunk states of the chunked delta rule
    widest_layer = max(attention, linear) + max(moe, dense)
    logits = 2 * max_running_requests * spec.vocab_size * 4
    # per running request with penalties, the sampler keeps output counts (fp32) and a seen mask (bool)
    logits += max_running_requests * (spec.vocab_size * 5 + 2 * ALLOC_GRANULE)
    return round_up(int((residual + widest_layer + logits) * 1.25), 2**20)


def offload_workspace_bytes(spec: ModelSpec, max_step_tokens: int) -> int:
    """What the offload store allocates per step beyond the all-resident compute path.

    Both stores compute the layer into a [T, k, H] row buffer that is summed over k, so
    that buffer is in the profiled (and estimated) workspace already. The offload store adds, per
    compute group (one live at a time), the group's [T, k] int64 slot map on the device, or the
    host-made alignment (sorted pairs and block slots, int32, at most 2 * T * k entries); plus one
    allocator block (512 B) for each of those small tensors. Small steps (the pair-by-pair kernel)
    send all their groups' [T, k] int32 slots at once instead: at most 2 * T * k * 4 bytes, less."""
    pairs = max_step_tokens * spec.num_experts_per_tok
    return round_up(pairs * 8 + 2 * pairs * 4 + 2 * 512, 512)
