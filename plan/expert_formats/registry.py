"""The expert formats' registry: one `ExpertFormat` object a format, registered by its module
(plan/expert_formats/<format>.py), looked up by name or by what a checkpoint says.

A format answers every question the plan asks of it (its rows' bytes, its host banks' bytes, the plan
report's words, the checkpoint quantization it holds); callers ask the object, never compare names
(tests/unit/test_format_names.py holds them to it). The worker's side of a format (torch: writing
checkpoint tensors into rows, the kernels it computes with, its dummy weights, its host banks) is the
class its `worker` names, in services/worker/expert_formats/.

This module imports no format (each format imports it; the package's __init__ imports the formats,
which registers them) and nothing of the model config: plan/quantization.py asks it which format a
checkpoint's experts are in, and plan/model_config.py imports that. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferry.shared.units import round_up

if TYPE_CHECKING:
    from ferry.plan.model_spec import ModelSpec

PART_ALIGN = 16  # every part of a quantized row starts here: vector loads, and fp32 views of the bytes
AUTO_BANKS = "auto"  # --expert-bank-format's default: each format's own choice (`banks_for`)
PLAIN_BANKS = "plain"  # --expert-bank-format's word for banks that hold experts as their slots do
PART_DTYPE_BYTES = {"uint8": 1, "float8_e4m3fn": 1, "float32": 4}
BIAS_PART = "bias"  # a quantized row's biases (float32 [rows]: the gate's then the up's for w13), where it has them
# Linears a checkpoint written in any quantized layout keeps bf16 (services/quantized_checkpoint.py):
# the routers and the shared expert's gate, one row each
CHECKPOINT_BF16_LINEARS = (".mlp.gate.weight", ".shared_expert_gate.weight")


@dataclass(frozen=True)
class RowPart:
    name: str  # q | scale | gscale
    dtype: str  # uint8 | float8_e4m3fn | float32
    shape: tuple[int, ...]  # per slot
    offset: int  # bytes from the row's start

    @property
    def nbytes(self) -> int:
        n = PART_DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class FamilyLayout:
    """One weight family of one expert in a quantized format: `rows` outputs, `cols` inputs,
    `part_rows` rows per projection (w13's gate and up are two), and its parts in one byte row (the
    expert's biases among them where it has them: `BIAS_PART`)."""

    fmt: str
    rows: int
    cols: int
    part_rows: int
    parts: tuple[RowPart, ...]
    nbytes: int


class ExpertFormat:
    """One expert format, plan side. A new format subclasses this in its own module, sets the class
    attributes below, overrides what differs, and `register`s one instance (see the package docstring)."""

    name: str = ""  # how the plan, /metrics and `generate --json` name it
    quantized = False  # the slots hold byte rows of `row_parts`; else [2I, H] / [H, I] in the run dtype
    slots_format: str | None = None  # a bank variant's slots' format (whose rows its banks hold otherwise)
    bank_word = PLAIN_BANKS  # --expert-bank-format's word for this format's host banks
    banks_keep = "experts as their slots hold them"  # what banks of that word keep (a refusal's words)
    # (quant_method, algo) pairs of a checkpoint's quantization_config whose routed experts are held in this
    # format (algo: modelopt's quant_algo, compressed-tensors' format, fp8's block scheme: plan/quantization.py)
    checkpoint_algos: tuple[tuple[str, str], ...] = ()
    checkpoint_layout: str | None = None  # `ferry make-bench-model --format`'s word for the layout it writes
    # its rows also hold each expert's biases (ModelSpec.expert_bias) and its kernels compute them and the clamped
    # SwiGLU (kernels/expert_epilogue.py); a model with either is refused a format without them
    # (plan/model_config.py), and --expert-bank-format a bank variant without them
    holds_biases = False
    worker = ""  # "module:Class" of its torch side (services/worker/expert_formats/)
    cuda_kernels = True  # the expert kernels read its slots on CUDA (else the worker refuses it there at boot)

    def reads_on_cuda(self, spec: ModelSpec) -> bool:
        """Whether the CUDA expert kernels read this model's slots of this format (the worker refuses it on CUDA at
        boot otherwise): `cuda_kernels`, unless the format's rows differ by model (gguf-mixed's types)."""
        return self.cuda_kernels

    @property
    def module_stem(self) -> str:
        """Its modules' file name, the same under plan/expert_formats/ and services/worker/expert_formats/."""
        return type(self).__module__.rsplit(".", 1)[-1]

    # ---- the slots and the banks ---------------------------------------------------------------
    def row_parts(self, rows: int, cols: int, part_rows: int) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """A quantized format's parts of one family's byte row: (name, dtype, shape) each, in order."""
        raise ValueError(f"{self.name} experts are not held in byte rows")

    def family_layout(self, rows: int, cols: int, part_rows: int, bias: bool = False) -> FamilyLayout:
        """The byte row of one family (rows x cols values): the parts one after the other, each at PART_ALIGN;
        with `bias` (experts with biases, in a format that `holds_biases`) a float32 `bias` part [rows] last."""
        parts, cursor = [], 0
        row_parts = self.row_parts(rows, cols, part_rows)
        if bias:
            row_parts = (*row_parts, (BIAS_PART, "float32", (rows,)))
        for part_name, dtype, shape in row_parts:
            part = RowPart(part_name, dtype, shape, cursor)
            parts.append(part)
            cursor = round_up(cursor + part.nbytes, PART_ALIGN)
        return FamilyLayout(self.name, rows, cols, part_rows, tuple(parts), cursor)

    def bias_rows(self, spec: ModelSpec) -> tuple[int, int]:
        """Rows appended to a slot's (w13 [2I, H], w2 [H, I]) to hold the expert's biases (2I and H values,
        row after row, the rest zero): ceil(2I / H) and ceil(H / I); (0, 0) for experts without biases.
        Kept in the slot's rows so that every copy path moves an expert's biases with it."""
        if not spec.expert_bias:
            return 0, 0
        h, i = spec.hidden_size, spec.moe_intermediate_size
        return -(-2 * i // h), -(-h // i)

    def expert_layouts(self, spec: ModelSpec) -> tuple[FamilyLayout, FamilyLayout]:
        """(w13, w2) byte rows of one expert of this model."""
        h, i = spec.hidden_size, spec.moe_intermediate_size
        bias = spec.expert_bias and self.holds_biases
        return self.family_layout(2 * i, h, i, bias), self.family_layout(h, i, h, bias)

    def row_types(self, spec: ModelSpec) -> dict[str, dict[str, int]]:
        """A format whose rows differ by MoE layer: per family (w13, w2), the MoE layers of each row type;
        {} for one row type in every layer."""
        return {}

    def row_padding_bytes(self, spec: ModelSpec) -> int:
        """Bytes of every routed expert's rows left unused: a layer whose rows are smaller than the slot's (sized
        to the largest layer's: the pool is shared by all layers) uses the row's prefix. 0 for one row size."""
        return 0

    def worker_options(self, spec: ModelSpec) -> dict:
        """Keyword arguments of its worker class's `for_shapes` beyond the sizes (what its rows need of the spec)."""
        return {}

    def slot_rows(self, spec: ModelSpec, dtype: str) -> tuple[tuple[tuple[int, ...], str], tuple[tuple[int, ...], str]]:
        """((shape, dtype) of one slot's w13, of its w2): byte rows for a quantized format."""
        w13, w2 = self.expert_layouts(spec)
        return ((w13.nbytes,), "uint8"), ((w2.nbytes,), "uint8")

    def slot_family_bytes(self, spec: ModelSpec, value_bytes: int) -> tuple[int, int]:
        """Bytes of one slot's (w13, w2), the run dtype's values being `value_bytes` each."""
        w13, w2 = self.expert_layouts(spec)
        return w13.nbytes, w2.nbytes

    def bank_bytes(self, spec: ModelSpec, value_bytes: int) -> int:
        """Every routed expert of every MoE layer in this format's host banks: by default as the slots hold them."""
        return spec.total_experts * sum(self.slot_family_bytes(spec, value_bytes))

    def banks_for(self, requested: str, dtype: str, biases: bool = False) -> ExpertFormat:
        """The format of the host banks behind slots of this format, for --expert-bank-format `requested`
        (auto or a format's bank word), the run dtype and whether the experts have biases: this format, or
        one of its bank variants (the formats whose `slots_format` is this one); a ValueError naming the
        flag for one it cannot hold."""
        variants = [f for f in _FORMATS.values() if f.slots_format == self.name]
        if requested == AUTO_BANKS:
            return next((v for v in variants if v.auto_for(dtype) and (v.holds_biases or not biases)), self)
        if requested == self.bank_word:
            return self
        for variant in variants:
            if variant.bank_word == requested:
                variant.check_run_dtype(dtype)
                if biases and not variant.holds_biases:
                    raise ValueError(
                        f"--expert-bank-format {requested} keeps {variant.banks_keep} without biases; this "
                        f"model's experts have biases: use --expert-bank-format {AUTO_BANKS} (or {self.bank_word})"
                    )
                return variant
        holder = next(f for f in _FORMATS.values() if f.bank_word == requested)
        raise ValueError(
            f"--expert-bank-format {requested} keeps {holder.banks_keep}; this checkpoint's experts are "
            f"{self.name}, kept as they are: use --expert-bank-format {AUTO_BANKS} (or {self.bank_word})"
        )

    def auto_for(self, dtype: str) -> bool:
        """A bank variant: whether --expert-bank-format auto picks it for a model of run dtype `dtype`."""
        return False

    def check_run_dtype(self, dtype: str) -> None:
        """A bank variant: a ValueError naming the flags when it cannot hold experts of run dtype `dtype`."""

    # ---- the checkpoints it is written in ------------------------------------------------------------
    def checkpoint_quantizes(self, name: str) -> bool:
        """Whether its published layout quantizes linear weight `name` (one that CHECKPOINT_BF16_LINEARS and
        lm_head leave out)."""
        return False

    def checkpoint_config(self, modules: list[str]) -> dict | None:
        """config.json's quantization_config of a checkpoint in its layout with these linear modules; None: none."""
        return None

    # ---- what the plan says of it ----------------------------------------------------------------
    def display_name(self, dtype: str) -> str:
        """Its name in a plan of run dtype `dtype`."""
        return self.name

    def banks_detail(self, experts: int, bytes_per_slot: int) -> str:
        """The plan report's words on host banks of `experts` experts in this format."""
        return (
            f"every routed expert pinned in host RAM in {self.name}, as the slots hold it "
            f"({experts} x {bytes_per_slot} B)"
        )


_FORMATS: dict[str, ExpertFormat] = {}


def register(fmt: ExpertFormat) -> ExpertFormat:
    """Add a format (its module does, once, when plan/expert_formats/__init__ imports it)."""
    if not fmt.name or fmt.name in _FORMATS:
        raise ValueError(f"an expert format needs a name of its own, got {fmt.name!r}")
    _FORMATS[fmt.name] = fmt
    return fmt


def registered() -> tuple[ExpertFormat, ...]:
    return tuple(_FORMATS.values())


def get(name: str) -> ExpertFormat:
    if name not in _FORMATS:
        raise ValueError(f"{name!r} is not an expert format ({', '.join(_FORMATS)})")
    return _FORMATS[name]


def unquantized() -> ExpertFormat:
    """The format of experts a checkpoint does not quantize (and whose slots are its own)."""
    return next(f for f in _FORMATS.values() if not f.quantized and f.slots_format is None)


def for_checkpoint(method: str, algo: str) -> ExpertFormat | None:
    """The format that holds routed experts a checkpoint quantizes with `algo` under `method`; None: none does."""
    return next((f for f in _FORMATS.values() if (method, algo) in f.checkpoint_algos), None)


def for_checkpoint_layout(layout: str) -> ExpertFormat:
    """The format whose published layout `ferry make-bench-model --format layout` writes."""
    for fmt in _FORMATS.values():
        if fmt.checkpoint_layout == layout:
            return fmt
    raise ValueError(f"--format must be one of {', '.join(checkpoint_layouts())}, got {layout!r}")


def checkpoint_layouts() -> tuple[str, ...]:
    return tuple(f.checkpoint_layout for f in _FORMATS.values() if f.checkpoint_layout)


def bank_words() -> tuple[str, ...]:
    """--expert-bank-format's choices: auto, then every format's banks' word once (alphabetical)."""
    return (AUTO_BANKS, *sorted({f.bank_word for f in _FORMATS.values()}))
