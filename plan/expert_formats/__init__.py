"""Expert formats: how the routed experts are held in host RAM, in their GPU slots and across PCIe.

One concept, several formats (docs/ARCHITECTURE.md §3, "Expert formats"), one module each here (the plan's
side: torch-free) and one each under services/worker/expert_formats/ (the worker's: torch):

| format | host banks | slots | what one copy moves |
| --- | --- | --- | --- |
| `bf16` | as the slots hold them | the run dtype, [2I, H] and [H, I] | 6 I H bytes |
| `bf16-packed` | 12 bits a value, lossless | the run dtype | 4.5 I H bytes, unpacked as it lands |
| `nvfp4` | as the slots hold them | e2m1 codes + float8 group scales + per-row fp32 scales | ~1.69 I H bytes |
| `fp8-block` | as the slots hold them | float8_e4m3fn + fp32 128x128 block scales | ~3 I H bytes |
| `mxfp4` | as the slots hold them | e2m1 codes + e8m0 scales of 32 inputs | ~1.59 I H bytes |
| `gguf-q8_0`, `-q4_0`... `-iq4_xs`, `-mxfp4` | as the slots hold them | a GGUF file's blocks | 1.59 to 3.19 I H bytes |
| `gguf-mixed` | as the slots hold them | a GGUF file's blocks, each layer's in its own types | its types', padded |

(`bf16` is the unquantized format in whatever dtype the model runs: float32 in the CPU tests.)
The quantized formats keep each weight family of an expert (w13 = [gate; up], w2 = down) as one row
of bytes: its parts one after the other, each at a PART_ALIGN boundary, so an expert is still one
contiguous copy per family, and the kernels read typed views of the parts (kernels/quantized_experts.py).
The format object (registry.ExpertFormat) is the one price of those rows: the pool layout, the host
banks and the worker's views all come from it.

Adding a format, file by file:
1. plan/expert_formats/<name>.py: an ExpertFormat subclass (name, `quantized`, `row_parts` for byte rows,
   `checkpoint_algos` it recognizes, `bank_word` / `bank_bytes` if its banks differ, `banks_detail`,
   `checkpoint_layout` / `checkpoint_config` if `ferry make-bench-model` writes it, `worker`, `worker_options` if
   its worker needs more of the spec than the sizes, `row_types` / `row_padding_bytes` if its rows differ by
   layer), then `FORMAT = register(...)`; import it below.
2. services/worker/expert_formats/<name>.py: its worker class (that module's docstring lists what).
3. The kernels for its rows, if the existing ones do not read them (kernels/quantized_experts.py).
Nothing else names it: tests/unit/test_format_names.py fails where something does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.plan.dtypes import DTYPE_BYTES
from ferry.plan.expert_formats import (  # noqa: F401 (importing one registers it)
    bf16,
    bf16_packed,
    fp8_block,
    gguf_iq4_nl,
    gguf_iq4_xs,
    gguf_mixed,
    gguf_mxfp4,
    gguf_q4_0,
    gguf_q4_1,
    gguf_q4_k,
    gguf_q5_0,
    gguf_q5_1,
    gguf_q5_k,
    gguf_q6_k,
    gguf_q8_0,
    mxfp4,
    nvfp4,
)
from ferry.plan.expert_formats.bf16 import BF16
from ferry.plan.expert_formats.bf16_packed import BF16_PACKED
from ferry.plan.expert_formats.fp8_block import FP8_BLOCK, FP8_BLOCK_SIZE
from ferry.plan.expert_formats.mxfp4 import E8M0_BIAS, MXFP4, MXFP4_GROUP
from ferry.plan.expert_formats.nvfp4 import E2M1_VALUES, NVFP4, NVFP4_GROUP
from ferry.plan.expert_formats.registry import (
    AUTO_BANKS,
    BIAS_PART,
    PART_ALIGN,
    PLAIN_BANKS,
    ExpertFormat,
    FamilyLayout,
    RowPart,
    bank_words,
    checkpoint_layouts,
    for_checkpoint,
    for_checkpoint_layout,
    get,
    register,
    registered,
    unquantized,
)

if TYPE_CHECKING:
    from ferry.plan.model_spec import ModelSpec

__all__ = [
    "AUTO_BANKS",
    "BIAS_PART",
    "BF16",
    "BF16_PACKED",
    "E2M1_VALUES",
    "E8M0_BIAS",
    "FP8_BLOCK",
    "FP8_BLOCK_SIZE",
    "FORMATS",
    "MXFP4",
    "MXFP4_GROUP",
    "NVFP4",
    "NVFP4_GROUP",
    "PART_ALIGN",
    "PLAIN_BANKS",
    "ExpertFormat",
    "FamilyLayout",
    "RowPart",
    "bank_words",
    "checkpoint_layouts",
    "for_checkpoint",
    "for_checkpoint_layout",
    "get",
    "register",
    "registered",
    "unquantized",
]

FORMATS = tuple(f.name for f in registered())


def family_layout(fmt: str, rows: int, cols: int, part_rows: int) -> FamilyLayout:
    """The byte row of one family (rows x cols values) in quantized format `fmt`."""
    return get(fmt).family_layout(rows, cols, part_rows)


def format_of(spec: ModelSpec) -> ExpertFormat:
    """What the slots hold: the checkpoint's quantized expert format, else the unquantized one."""
    q = spec.quantization
    return get(q.expert_format) if q is not None and q.expert_format else unquantized()


def slot_format(spec: ModelSpec) -> str:
    """The name of what the slots hold (format_of)."""
    return format_of(spec).name


def expert_layouts(spec: ModelSpec) -> tuple[FamilyLayout, FamilyLayout]:
    """(w13, w2) byte rows of a model whose experts are quantized."""
    return format_of(spec).expert_layouts(spec)


def slot_family_bytes(spec: ModelSpec, dtype: str) -> tuple[int, int]:
    """Bytes of one slot's (w13, w2)."""
    return format_of(spec).slot_family_bytes(spec, DTYPE_BYTES[dtype])


def banks_format(spec: ModelSpec, bank_word: str, dtype: str) -> ExpertFormat:
    """The format of this model's host banks for --expert-bank-format `bank_word` (auto: the format's choice)."""
    return format_of(spec).banks_for(bank_word, dtype, spec.expert_bias)


def expert_format_name(spec: ModelSpec, bank_word: str | None, dtype: str = "bfloat16") -> str:
    """The format's name for the plan, /metrics and `generate --json`: the slots' format, or with host banks
    (`bank_word`, None: none) the banks' (`bf16-packed` when packed); for unquantized experts in another
    dtype than bf16 the run dtype's name (e.g. `float32` on CPU)."""
    fmt = format_of(spec) if bank_word is None else banks_format(spec, bank_word, dtype)
    return fmt.display_name(dtype)


def named(name: str) -> ExpertFormat:
    """The format a plan names `name` (expert_format_name): a registered one, else the unquantized
    format in a run dtype of that name (`float32`)."""
    return get(name) if name in FORMATS else unquantized()
