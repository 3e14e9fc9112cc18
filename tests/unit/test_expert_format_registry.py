"""Every registered expert format is a whole slice: its plan side (plan/expert_formats/<format>.py) names a
worker class that answers every question the worker asks a format, checkpoints map to one format each,
bank variants are well formed, and the registry's lookups find what the formats registered."""

from __future__ import annotations

import pytest
import torch

from ferry.plan import expert_formats as F
from ferry.services.worker.expert_formats import ExpertFormat, worker_class
from ferry.services.worker.offload.host_compute.host_expert_kernel import KernelUnavailable

HIDDEN, INTER = 256, 256  # whole blocks of every format (GGUF K blocks hold 256 values)
# the protocol's attributes and methods: what the worker asks of any format
WORKER_MEMBERS = [
    *ExpertFormat.__annotations__,
    *(n for n, v in vars(ExpertFormat).items() if callable(v) and n[0] != "_"),
]

# what a format's `worker_options(spec)` gives beyond the sizes, for the formats whose rows need the spec
WORKER_OPTIONS = {"gguf-mixed": {"layer_types": (("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"))}}


def _worker(fmt):
    return worker_class(fmt).for_shapes(HIDDEN, INTER, torch.bfloat16, **WORKER_OPTIONS.get(fmt.name, {}))


@pytest.mark.parametrize("fmt", F.registered(), ids=lambda f: f.name)
def test_each_format_names_a_worker_class_with_every_member(fmt):
    cls = worker_class(fmt)
    assert cls.plan is fmt
    worker = _worker(fmt)
    assert worker.name == fmt.display_name("bfloat16") and worker.quantized == fmt.quantized
    assert {"copy_engine_default", "host_reader", "write_expert"} <= set(WORKER_MEMBERS)
    missing = [m for m in ("for_shapes", *WORKER_MEMBERS) if not hasattr(worker, m)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    if fmt.quantized:
        assert hasattr(worker, "fill_dummy_layer")
        (shape13, dtype13), (shape2, dtype2) = worker.row_shapes()
        assert (shape13, shape2) == ((worker.layout13.nbytes,), (worker.layout2.nbytes,)) and dtype13 == torch.uint8
    if fmt.checkpoint_layout and fmt.quantized:
        assert callable(cls.quantize_linear)


def test_host_kernel_codes_differ_between_formats():
    """One C kernel format a format, the GGUF ones' told apart by their block type (each family's, in the kernel)."""
    codes = {}
    for fmt in F.registered():
        worker = _worker(fmt)
        try:
            codes[fmt.name] = (worker.host_kernel_format(), getattr(worker, "ggml_type", None))
        except KernelUnavailable:
            continue
    assert len(set(codes.values())) == len(codes), codes


def test_a_checkpoint_quantization_belongs_to_one_format():
    claimed = [(pair, fmt) for fmt in F.registered() for pair in fmt.checkpoint_algos]
    assert len({pair for pair, _ in claimed}) == len(claimed)
    for pair, fmt in claimed:
        assert F.for_checkpoint(*pair) is fmt and fmt.quantized
    assert F.for_checkpoint("modelopt", "INT4_AWQ") is None


def test_bank_variants_keep_their_slots_format_and_a_word_of_their_own():
    words = [fmt.bank_word for fmt in F.registered() if fmt.slots_format is not None]
    assert len(words) == len(set(words)) and F.PLAIN_BANKS not in words
    for fmt in F.registered():
        if fmt.slots_format is not None:
            slots = F.get(fmt.slots_format)
            assert slots.slots_format is None and not slots.quantized
            assert slots.banks_for(fmt.bank_word, "bfloat16") is fmt
    assert F.bank_words()[0] == F.AUTO_BANKS and set(F.bank_words()) == {
        F.AUTO_BANKS,
        *(f.bank_word for f in F.registered()),
    }


def test_a_quantized_format_refuses_another_formats_bank_word():
    variant = next(f for f in F.registered() if f.slots_format is not None)
    quantized = next(f for f in F.registered() if f.quantized)
    with pytest.raises(ValueError, match=f"--expert-bank-format {variant.bank_word} keeps"):
        quantized.banks_for(variant.bank_word, "bfloat16")
    assert quantized.banks_for(F.AUTO_BANKS, "bfloat16") is quantized


def test_checkpoint_layouts_find_their_format():
    for layout in F.checkpoint_layouts():
        assert F.for_checkpoint_layout(layout).checkpoint_layout == layout
    with pytest.raises(ValueError, match="--format must be one of"):
        F.for_checkpoint_layout("int4")


def test_the_unquantized_format_is_the_one_whose_slots_hold_the_run_dtype():
    fmt = F.unquantized()
    assert not fmt.quantized and fmt.slots_format is None
    assert F.named("float32") is fmt and F.named(fmt.name) is fmt
    assert all(F.named(f.name) is f for f in F.registered())
