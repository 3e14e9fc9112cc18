"""GGUF files (issue 60) on CPU: a tiny qwen3_moe written as llama.cpp lays a GGUF out (tests/gguf_models.py)
is read from its metadata alone (architecture, sizes, tokenizer, chat template), its routed experts kept in
their blocks, and it generates what transformers generates on the same file decoded by the gguf package,
all resident and offloaded; the blocks decode as that package decodes them, a Q4_K scale unpacked one bit
off breaks the comparison, and what is not served is refused by `ferry plan`, naming it."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.gguf_models import dequantized_reference, tiny_gguf
from tests.unit.test_generate_e2e import ferry_generate
from tests.unit.test_quantized_checkpoints import _hf_greedy_logprobs

PROMPT = ",".join(str((i * 37 + 11) % 200) for i in range(40))
ARGS = ("--prompt-ids", PROMPT, "--max-tokens", "8", "--ignore-eos", "--dtype", "float32", "--temperature", "0")
TOLERANCE = 0.05  # the quantized Qwen tests' bound (tests/unit/test_quantized_checkpoints.py)
MULTILINGUAL = (
    "The ferry leaves at 7:45 — Die Fähre fährt um sieben. Le traversier part à l'heure. Паром отходит в семь. "
    "渡轮七点出发。フェリーは七時に出発します。페리는 7시에 출발합니다. العبّارة تغادر 🚢 <|im_end|> done"
)


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """{ggml type: (GGUF file, its float32 reference checkpoint)}, made once, from one tiny checkpoint."""
    root = tmp_path_factory.mktemp("gguf")
    made, hf_dir = {}, None

    def get(expert_type: str):
        nonlocal hf_dir
        if expert_type not in made:
            path, hf_dir = tiny_gguf(root, expert_type, hf_dir)
            made[expert_type] = (path, dequantized_reference(path, hf_dir, root / f"reference-{expert_type}"), hf_dir)
        return made[expert_type]

    return get


def _worst(got: dict, reference_dir) -> float:
    prompt = [int(i) for i in PROMPT.split(",")]
    want = _hf_greedy_logprobs(reference_dir, prompt, got["token_ids"])
    return max(abs(a - b) for a, b in zip(got["logprobs"], want))


def _served_resident_and_offloaded(capsys, path, reference, fmt: str) -> None:
    """`path` served all-resident within TOLERANCE of `reference`, its experts held as `fmt`; and offloaded (9
    slots, misses crossing) the same tokens and logprobs."""
    resident = ferry_generate(capsys, path, *ARGS)
    assert resident["plan"]["experts"]["format"] == fmt
    assert _worst(resident, reference) < TOLERANCE
    offloaded = ferry_generate(capsys, path, *ARGS, "--moe-cache-size", "9")
    assert offloaded["expert_cache"]["misses"] > 0
    assert offloaded["token_ids"] == resident["token_ids"] and offloaded["logprobs"] == resident["logprobs"]


# ---- the blocks against the gguf package's decode --------------------------------------------------------


def _random_blocks(ggml_type: str, rows: int, row_blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes with finite fp16 scales (where the expert format's dummy weights set them; Q2_K's d at 80):
    valid blocks of every code and 6-bit scale."""
    import gguf

    from ferry.plan import expert_formats as F
    from ferry.services.worker.expert_formats import worker_class

    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[ggml_type]][1]
    blocks = np.random.default_rng(seed).integers(0, 256, (rows, row_blocks * size), dtype=np.uint8)
    if (
        ggml_type == "MXFP4"
    ):  # the e8m0 scale bytes whose codes stay finite (0 to 252), the two subnormal ones (0, 1) included
        blocks.reshape(-1, size)[:, 0] = np.arange(rows * row_blocks) % 253
        return blocks
    fields = ((80, 1.0),) if ggml_type == "Q2_K" else worker_class(F.get(f"gguf-{ggml_type.lower()}")).scale_fields
    for offset, _ in fields:
        scales = np.random.default_rng(seed + 1).uniform(1e-3, 1e-2, rows * row_blocks).astype(np.float16)
        blocks.reshape(-1, size)[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks


# every block type a GGUF expert format holds
GGUF_BLOCK_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"]


@pytest.mark.parametrize("ggml_type", GGUF_BLOCK_TYPES)
def test_the_torch_twin_decodes_blocks_as_the_gguf_package(ggml_type):
    import gguf

    from ferry.kernels.gguf_blocks import BLOCKS, dequantize_rows

    qtype = gguf.GGMLQuantizationType[ggml_type]
    assert BLOCKS[ggml_type] == gguf.GGML_QUANT_SIZES[qtype]
    blocks = _random_blocks(ggml_type, rows=96, row_blocks=3)
    want = gguf.quants.dequantize(blocks, qtype)
    assert torch.equal(dequantize_rows(torch.from_numpy(blocks), ggml_type, torch.float32), torch.from_numpy(want))


# ---- tiny GGUF models against transformers on the decoded file ---------------------------------------------


@pytest.mark.parametrize("ggml_type", GGUF_BLOCK_TYPES)
def test_gguf_tiny_models_generate_as_transformers_on_the_decoded_file(gguf_models, capsys, ggml_type):
    path, reference, _ = gguf_models(ggml_type)
    fmt = f"gguf-{ggml_type.lower()}"
    resident = ferry_generate(capsys, path, *ARGS)
    assert resident["plan"]["experts"]["format"] == fmt == resident["expert_cache"]["expert_format"]
    assert _worst(resident, reference) < TOLERANCE
    if ggml_type not in ("Q8_0", "Q4_K"):
        return  # offloading moves bytes without reading them: two types show it
    offloaded = ferry_generate(capsys, path, *ARGS, "--moe-cache-size", "9")
    assert offloaded["token_ids"] == resident["token_ids"] and offloaded["logprobs"] == resident["logprobs"]
    cache = offloaded["expert_cache"]
    assert (
        cache["misses"] > 0
        and cache["bytes_copied"] == cache["misses"] * offloaded["plan"]["experts"]["bytes_per_slot"]
    )
    # --expert-backend cpu: the same tokens (on a CPU device every expert is computed there already)
    host = ferry_generate(capsys, path, *ARGS, "--moe-cache-size", "9", "--expert-backend", "cpu")
    assert host["plan"]["expert_backend"]["backend"] == "cpu" and host["token_ids"] == resident["token_ids"]
    assert max(abs(a - b) for a, b in zip(host["logprobs"], resident["logprobs"])) < 1e-4


def test_a_q4_k_scale_unpacked_one_bit_off_fails_the_comparison(gguf_models, capsys, monkeypatch):
    """The high bits of scales 4-7 shifted by three instead of two: the comparison must catch it."""
    from ferry.kernels import gguf_blocks

    def off_by_one_bit(scales):
        d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
        sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 3) & 0x30)), dim=1)
        mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
        return sc, mn

    path, reference, _ = gguf_models("Q4_K")
    monkeypatch.setattr(gguf_blocks, "k_scales", off_by_one_bit)
    assert _worst(ferry_generate(capsys, path, *ARGS), reference) > TOLERANCE


@pytest.mark.parametrize("ggml_type", ["IQ4_NL", "IQ4_XS"])
def test_a_wrong_iq4_grid_fails_the_comparison(gguf_models, capsys, monkeypatch, ggml_type):
    """The non-linear grid with two neighbouring values swapped: the comparison must catch it."""
    from ferry.kernels import gguf_blocks

    path, reference, _ = gguf_models(ggml_type)
    grid = list(gguf_blocks.IQ4_GRID)
    grid[7], grid[8] = grid[8], grid[7]
    monkeypatch.setattr(gguf_blocks, "IQ4_GRID", tuple(grid))
    assert _worst(ferry_generate(capsys, path, *ARGS), reference) > TOLERANCE


def test_mxfp4_nibbles_read_high_first_fail_the_comparison(gguf_models, capsys, monkeypatch):
    """ggml's MXFP4 holds values 0-15 in the low nibbles, 16-31 in the high: read the other way, it must fail."""
    from ferry.kernels import gguf_blocks

    path, reference, _ = gguf_models("MXFP4")
    assert _worst(ferry_generate(capsys, path, *ARGS), reference) < TOLERANCE
    monkeypatch.setattr(gguf_blocks, "_low_high", lambda qs: torch.cat((qs >> 4, qs & 0x0F), dim=1))
    assert _worst(ferry_generate(capsys, path, *ARGS), reference) > TOLERANCE


@pytest.mark.parametrize("ggml_type", GGUF_BLOCK_TYPES)
def test_dummy_experts_have_the_spread_asked_for(ggml_type):
    """Dummy weights are random bytes whose scales are set (the fp16 `scale_fields`; MXFP4's one e8m0 byte) so
    that the decoded values have the spread asked for."""
    from ferry.kernels.gguf_blocks import dequantize_rows
    from ferry.plan import expert_formats as F
    from ferry.services.worker.expert_formats import worker_class

    fmt = F.get(f"gguf-{ggml_type.lower()}")
    layout = fmt.family_layout(64, 256, 32)
    rows = torch.zeros(2, layout.nbytes, dtype=torch.uint8)
    cls = worker_class(fmt)
    experts = cls.__new__(cls)  # the fill reads only class attributes
    experts._fill_dummy(rows, layout, 0.02, torch.Generator().manual_seed(0))
    (q,) = layout.parts
    values = dequantize_rows(rows[0, q.offset : q.offset + q.nbytes].view(64, -1), ggml_type, torch.float32)
    assert 0.5 * 0.02 < float(values.std()) < 2 * 0.02


def test_the_plan_prices_each_expert_at_its_blocks_bytes(gguf_models, capsys):
    from ferry.services.cli import main

    path, _, _ = gguf_models("Q4_K")
    assert main(["plan", str(path), "--gpu-memory", "24GiB", "--host-memory", "8GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    experts = plan["experts"]
    # w13: 512 rows of one 144-byte Q4_K block (256 values); w2: 256 rows of one block
    assert experts["bytes_per_slot"] == 512 * 144 + 256 * 144 and experts["format"] == "gguf-q4_k"
    # the dense tensors cost run-dtype bytes on the GPU, whatever their type in the file
    assert plan["weights_source"] == "shapes: the GGUF's dense tensors, dequantized to bfloat16 at load"


# ---- the tokenizer and the config from the metadata ----------------------------------------------------------


def test_the_tokenizer_from_the_metadata_encodes_as_the_one_it_was_written_from(gguf_models):
    from transformers import AutoTokenizer

    from ferry.shared.eos import eos_token_ids
    from ferry.shared.tokenizer_source import load_tokenizer

    path, _, hf_dir = gguf_models("Q8_0")
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(hf_dir)
    assert ours(MULTILINGUAL)["input_ids"] == theirs(MULTILINGUAL)["input_ids"]
    assert ours.decode(ours(MULTILINGUAL)["input_ids"]) == MULTILINGUAL
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wohin fährt die Fähre?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    assert eos_token_ids(path) == (theirs.eos_token_id,) == eos_token_ids(path, ours)


def test_a_transformers_without_the_torch_free_gguf_tables_is_named_with_the_version_to_install(
    gguf_models, monkeypatch
):
    """transformers before 5.18 kept the GGUF tokenizer tables in a package that imports torch, which the api
    forbids (shared/torch_free.py): the error says which transformers to install, not "import of torch halted"."""
    import sys

    from ferry.shared.tokenizer_source import load_tokenizer

    path, _, _ = gguf_models("Q8_0")
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.gguf_tokenizer_mapping", None)
    with pytest.raises(ValueError, match=r"needs transformers >= 5\.18 .*pip install 'transformers>=5\.18'"):
        load_tokenizer(path)


def test_the_config_comes_from_the_metadata(gguf_models):
    from ferry.plan.model_config import load_model_config

    path, _, hf_dir = gguf_models("Q8_0")
    spec, want = load_model_config(path), load_model_config(hf_dir)
    assert spec.quantization.expert_format == "gguf-q8_0" and want.quantization is None
    for field in (
        "arch",
        "vocab_size",
        "hidden_size",
        "num_layers",
        "moe_layers",
        "num_attention_heads",
        "num_kv_heads",
    ):
        assert getattr(spec, field) == getattr(want, field), field
    for field in ("head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert getattr(spec, field) == getattr(want, field), field
    assert spec.rope_theta == want.rope_theta and spec.tie_word_embeddings == want.tie_word_embeddings
    assert spec.rms_norm_eps == want.rms_norm_eps  # the float32 metadata read as config.json writes it


def test_a_directory_holding_the_file_and_a_split_set_are_read(gguf_models, tmp_path):
    from ferry.plan.gguf_checkpoint import find_gguf
    from ferry.plan.model_config import load_model_config
    from ferry.services.gguf_writer import write_gguf
    from ferry.shared.errors import ConfigError

    path, _, hf_dir = gguf_models("Q8_0")
    first = write_gguf(hf_dir, tmp_path / "split" / "tiny.gguf", "Q8_0", split_max_tensors=20)
    assert first.name == "tiny-00001-of-00002.gguf" and find_gguf(tmp_path / "split") == first
    split, single = load_model_config(tmp_path / "split"), load_model_config(path)
    assert split.quantization.source == str(first) and replace(split, quantization=single.quantization) == single
    with pytest.raises(ConfigError, match="give .*tiny-00001-of-00002.gguf"):
        find_gguf(first.with_name("tiny-00002-of-00002.gguf"))
    assert find_gguf(hf_dir) is None  # a Hugging Face directory (config.json) is not a GGUF one
    (tmp_path / "split" / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ConfigError, match="holds 2 GGUF models .*give the .gguf file itself"):
        find_gguf(tmp_path / "split")


def test_a_split_set_generates_as_the_single_file(gguf_models, tmp_path, capsys):
    from ferry.services.gguf_writer import write_gguf

    path, _, hf_dir = gguf_models("Q8_0")
    first = write_gguf(hf_dir, tmp_path / "tiny.gguf", "Q8_0", split_max_tensors=20)
    short = ("--prompt-ids", "1,2,3", "--max-tokens", "3", "--ignore-eos", "--dtype", "float32", "--temperature", "0")
    assert ferry_generate(capsys, first, *short)["logprobs"] == ferry_generate(capsys, path, *short)["logprobs"]


# ---- what is not served ------------------------------------------------------------------------------------


def test_ferry_plan_refuses_an_architecture_it_does_not_serve_naming_it(tmp_path, capsys):
    import gguf

    from ferry.services.cli import main

    path = tmp_path / "llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["plan", str(path), "--gpu-memory", "24GiB"]) == 2
    err = capsys.readouterr().err
    assert "GGUF architecture 'llama' is not served" in err and "qwen3moe" in err, err


def _rewritten(path, out, retyped: dict[str, str], dropped: tuple[str, ...] = ()):
    """`path` copied to `out` with the tensors of `retyped` ({name: ggml type}) replaced by random blocks, and
    those of `dropped` left out."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        main_type = field.types[0]
        value = field.contents()
        if main_type == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, main_type, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, main_type)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.name in dropped:
            continue
        if t.name in retyped:
            data = _random_blocks(retyped[t.name], shape[0] * shape[1], shape[2] // 256).reshape(shape[0], shape[1], -1)
            writer.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType[retyped[t.name]])
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_experts_of_mixed_types_are_served_each_layer_in_its_type(gguf_models, tmp_path, capsys):
    """llama.cpp's _M mixes give ffn_down_exps another type on some layers: held as gguf-mixed, each layer's rows
    decoded in its own type (read in another, the random Q6_K blocks would not match the reference)."""
    from ferry.plan.model_config import load_model_config

    path, _, hf_dir = gguf_models("Q4_K")
    mixed = _rewritten(path, tmp_path / "mixed.gguf", {"blk.1.ffn_down_exps.weight": "Q6_K"})
    spec = load_model_config(mixed)
    assert spec.quantization.expert_format == "gguf-mixed"
    assert spec.quantization.expert_types == (("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"), ("Q4_K", "Q4_K"))
    reference = dequantized_reference(mixed, hf_dir, tmp_path / "reference")
    resident = ferry_generate(capsys, mixed, *ARGS)
    assert resident["plan"]["experts"]["format"] == "gguf-mixed" and _worst(resident, reference) < TOLERANCE


def test_a_layer_whose_gate_and_up_differ_in_type_is_refused_naming_both(gguf_models, tmp_path, capsys):
    """w13 = [gate; up] is one byte row: one type a layer."""
    from ferry.services.cli import main

    path, _, _ = gguf_models("Q4_K")
    odd = _rewritten(path, tmp_path / "odd.gguf", {"blk.1.ffn_up_exps.weight": "Q6_K"})
    assert main(["plan", str(odd), "--gpu-memory", "24GiB"]) == 2
    err = capsys.readouterr().err
    assert "blk.1.ffn_gate_exps.weight is Q4_K but blk.1.ffn_up_exps.weight is Q6_K" in err, err


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M"])
def test_an_m_mix_tiny_model_generates_as_transformers_on_the_decoded_file(gguf_models, capsys, mix):
    """gate/up in the base type everywhere, down Q6_K on llama-quantize's more-bits layers (the last of three):
    resident, offloaded and computed by the host, against the reference and each other."""
    from ferry.plan.model_config import load_model_config

    path, reference, _ = gguf_models(mix)
    base = mix[:4]
    assert load_model_config(path).quantization.expert_types == ((base, base), (base, base), (base, "Q6_K"))
    resident = ferry_generate(capsys, path, *ARGS)
    assert resident["plan"]["experts"]["format"] == "gguf-mixed" == resident["expert_cache"]["expert_format"]
    assert _worst(resident, reference) < TOLERANCE
    if mix != "Q4_K_M":
        return  # offloading and the host path read rows the same way whatever the types: one mix shows it
    offloaded = ferry_generate(capsys, path, *ARGS, "--moe-cache-size", "9")
    assert offloaded["token_ids"] == resident["token_ids"] and offloaded["logprobs"] == resident["logprobs"]
    cache, experts = offloaded["expert_cache"], offloaded["plan"]["experts"]
    assert cache["misses"] > 0 and cache["bytes_copied"] == cache["misses"] * experts["bytes_per_slot"]
    # the banks are laid out as the slots: every expert at the slot's bytes, the padding priced in the plan
    assert cache["host_bank_bytes"] == offloaded["plan"]["host"]["expert_bank_bytes"] == 24 * experts["bytes_per_slot"]
    host = ferry_generate(capsys, path, *ARGS, "--moe-cache-size", "9", "--expert-backend", "cpu")
    assert host["plan"]["expert_backend"]["backend"] == "cpu" and host["token_ids"] == resident["token_ids"]
    assert max(abs(a - b) for a, b in zip(host["logprobs"], resident["logprobs"])) < 1e-4


def test_a_mix_read_with_one_layer_s_types_for_every_layer_fails_the_comparison(gguf_models, capsys, monkeypatch):
    """Every layer's rows decoded with the first layer's types (Q4_K for the last layer's Q6_K down): it must fail."""
    from ferry.services.worker.expert_formats.gguf_mixed import GgufMixedExperts

    path, reference, _ = gguf_models("Q4_K_M")
    views = GgufMixedExperts.gemm_views
    monkeypatch.setattr(GgufMixedExperts, "gemm_views", lambda self, w13, w2, moe_layer=None: views(self, w13, w2, 0))
    assert not _worst(ferry_generate(capsys, path, *ARGS), reference) < TOLERANCE  # NaN too: a Q6_K d read as Q4_K's


def test_expert_types_that_no_format_holds_or_that_miscount_the_layers_are_refused_naming_the_field(gguf_models):
    from ferry.plan.model_config import load_model_config, parse_model_config
    from ferry.plan.quantization import parse_quantization
    from ferry.shared.errors import ConfigError

    def config(expert_types):
        return {"quantization_config": {"quant_method": "gguf", "ggml_type": "mixed", "expert_types": expert_types}}

    assert parse_quantization(config([["Q4_K", "Q6_K"]])).expert_types == (("Q4_K", "Q6_K"),)
    for unheld in ("Q2_K", "mixed"):  # a layer's type is a block type: the mix itself is none
        with pytest.raises(ConfigError, match=f"ggml type '{unheld}', which no expert format holds"):
            parse_quantization(config([["Q4_K", unheld]]))
    with pytest.raises(ConfigError, match="expert_types must list"):
        parse_quantization(config([["Q4_K"]]))
    path, _, hf_dir = gguf_models("Q4_K_M")
    spec_config = json.loads((hf_dir / "config.json").read_text())
    spec_config.update(config([["Q4_K", "Q6_K"]] * 2))  # three MoE layers
    with pytest.raises(ConfigError, match=r"one \[w13 type, w2 type\] per MoE layer \(3\), got 2"):
        parse_model_config(spec_config)
    assert load_model_config(path).quantization.expert_format == "gguf-mixed"


def test_mixed_dummy_experts_fill_each_layer_in_its_types():
    """--load-format dummy: each layer's rows are filled as its types fill them (read in another, the fp16 scale
    would be some code byte) and decode with the spread asked for through that layer's views."""
    from ferry.kernels.quantized_experts import dequantize_slot
    from ferry.services.worker.expert_formats.gguf_mixed import GgufMixedExperts
    from ferry.services.worker.expert_formats.quantized import DUMMY_DOWN_STD, DUMMY_STD

    experts = GgufMixedExperts(256, 256, (("Q4_K", "Q4_K"), ("Q4_K", "Q6_K")))
    (shape13, _), (shape2, _) = experts.row_shapes()
    assert shape2 == (256 * 210,)  # the Q6_K layer's down rows
    for layer, down in enumerate(("Q4_K", "Q6_K")):
        w13, w2 = torch.zeros(3, *shape13, dtype=torch.uint8), torch.zeros(3, *shape2, dtype=torch.uint8)
        experts.fill_dummy_layer(w13, w2, layer, seed=0)
        f13, f2 = experts.gemm_views(w13, w2, layer)
        assert (f13.ggml_type, f2.ggml_type) == ("Q4_K", down)
        for family, std in ((f13, DUMMY_STD), (f2, DUMMY_DOWN_STD)):
            assert 0.5 * std < float(dequantize_slot(family, 2, torch.float32).std()) < 2 * std


def test_the_plan_sizes_mixed_rows_to_the_largest_layer_and_prices_the_padding(gguf_models, capsys):
    from ferry.plan.model_config import load_model_config
    from ferry.plan.pool_layout import expert_slot_layout
    from ferry.services.cli import main

    path, _, _ = gguf_models("Q4_K_M")
    flags = ["--gpu-memory", "24GiB", "--host-memory", "8GiB"]
    assert main(["plan", str(path), *flags, "--moe-cache-size", "9", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    experts = plan["experts"]
    # w13: 512 rows of one Q4_K block (144 B) in every layer; w2: 256 rows of one block, Q6_K (210 B) on the last
    # layer, Q4_K on the two others, which leave 256 x 66 B of each of their 8 experts' rows unused
    assert experts["bytes_per_slot"] == 512 * 144 + 256 * 210
    assert experts["row_types"] == {"w13": {"Q4_K": 3}, "w2": {"Q4_K": 2, "Q6_K": 1}}
    assert experts["row_padding_bytes"] == 2 * 8 * 256 * (210 - 144)
    assert plan["host"]["expert_bank_bytes"] == 24 * experts["bytes_per_slot"]
    # exact: the pool's layout is what the plan priced (boot allocates it and checks the same)
    spec = load_model_config(path)
    layout = expert_slot_layout(spec, plan["dtype"], experts["slots"], plan["max_prefill_tokens"])
    assert layout.nbytes == experts["bytes"]
    assert main(["plan", str(path), *flags]) == 0
    table = capsys.readouterr().out
    assert "gguf-mixed (MoE layers by row type: w13 Q4_K x3; w2 Q4_K x2, Q6_K x1" in table, table
    assert f"leave {2 * 8 * 256 * 66} B of the 24 experts' rows unused: 8.8%" in table, table


def test_make_tiny_model_writes_the_checkpoint_as_a_gguf_file(tmp_path, capsys):
    from ferry.plan.model_config import load_model_config
    from ferry.services.cli import main

    assert main(["make-tiny-model", str(tmp_path), "--gguf", "Q5_K"]) == 0
    assert "tiny-Q5_K.gguf" in capsys.readouterr().out
    spec = load_model_config(tmp_path / "tiny-Q5_K.gguf")
    assert spec.quantization.expert_format == "gguf-q5_k" and spec.hidden_size == spec.moe_intermediate_size == 256


def test_the_writer_s_m_mixes_give_down_more_bits_where_llama_quantize_does():
    from ferry.services.gguf_writer import more_bits

    # llama-quantize's use_more_bits over 48 blocks (Qwen3-30B-A3B): the first and last 6, and every third between
    assert [layer for layer in range(48) if more_bits(layer, 48)] == [*range(6), *range(8, 42, 3), *range(42, 48)]
    assert [more_bits(layer, 3) for layer in range(3)] == [False, False, True]


def test_experts_of_a_type_no_format_holds_are_refused_naming_it(gguf_models, tmp_path, capsys):
    from ferry.services.cli import main

    path, _, _ = gguf_models("Q4_K")
    experts = {f"blk.{b}.ffn_{p}_exps.weight": "Q2_K" for b in range(3) for p in ("gate", "up", "down")}
    q2 = _rewritten(path, tmp_path / "q2_k.gguf", experts)
    assert main(["plan", str(q2), "--gpu-memory", "24GiB"]) == 2
    err = capsys.readouterr().err
    assert "ggml type 'Q2_K', which no expert format holds" in err and "Q4_K" in err, err


def test_ferry_plan_and_the_api_tokenizer_read_a_gguf_where_importing_torch_raises(gguf_models):
    """The control plane never imports torch: the GGUF is read by the gguf package, its config and tokenizer
    mapped by transformers' torch-free GGUF tables. torch is marked absent as shared/torch_free.py does
    (transformers probes for it, so a find_spec that raises would fail transformers itself)."""
    from tests.unit.test_torch_free import TOKENIZER, run

    path, _, _ = gguf_models("Q8_0")
    plan = (
        'import sys, runpy; sys.modules["torch"] = None; sys.argv[0] = "ferry"; '
        'runpy.run_module("ferry.services.cli", run_name="__main__")'
    )
    done = run(plan, "plan", str(path), "--gpu-memory", "24GiB", "--host-memory", "8GiB", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["experts"]["format"] == "gguf-q8_0", done.stderr
    done = run(TOKENIZER, str(path))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr


def test_gguf_types_without_cuda_kernels_are_refused_on_cuda_before_the_device_is_touched(
    gguf_models, capsys, monkeypatch, tmp_path
):
    """A block type whose format has no CUDA kernels (`cuda_kernels`, GgufBlockFormat's default: a type added with
    only the twin) is refused by boot on a GPU, alone or in a mix; here Q4_0 and Q5_K stand for such a type."""
    from ferry.plan import expert_formats
    from ferry.services.cli import main
    from ferry.services.worker import boot

    path, _, _ = gguf_models("Q4_0")
    monkeypatch.setattr(boot, "select_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(expert_formats.get("gguf-q4_0"), "cuda_kernels", False)
    assert main(["generate", str(path), "--prompt-ids", "1,2", "--max-tokens", "1", "--gpu-memory", "64MiB"]) == 2
    assert "gguf-q4_0, which no CUDA expert kernel reads yet" in capsys.readouterr().err
    mixed, _, _ = gguf_models("Q4_K_M")
    with_q5_k = _rewritten(mixed, tmp_path / "q4_k_m_q5_k.gguf", {"blk.1.ffn_down_exps.weight": "Q5_K"})
    monkeypatch.setattr(expert_formats.get("gguf-q5_k"), "cuda_kernels", False)
    assert main(["generate", str(with_q5_k), "--prompt-ids", "1,2", "--max-tokens", "1", "--gpu-memory", "64MiB"]) == 2
    assert "gguf-mixed, which no CUDA expert kernel reads yet" in capsys.readouterr().err


def test_every_gguf_block_type_and_mixes_of_them_are_read_on_cuda(gguf_models, tmp_path):
    """Every block type a GGUF expert format holds has Triton kernels (kernels/gguf_block_decode.py's
    GGUF_KERNEL_TYPES) and its format says so (the check boot makes); a Q4_K_M mix of Q4_K and Q6_K, and one with a
    Q5_K layer, too."""
    from ferry.kernels.gguf_block_decode import GGUF_KERNEL_TYPES
    from ferry.plan import expert_formats
    from ferry.plan.expert_formats.gguf_blocks import GgufBlockFormat
    from ferry.services.worker.loader import open_model

    block_formats = [f for f in expert_formats.registered() if isinstance(f, GgufBlockFormat)]
    assert sorted(f.ggml_type for f in block_formats) == sorted(GGUF_BLOCK_TYPES) == sorted(GGUF_KERNEL_TYPES)
    assert all(f.cuda_kernels for f in block_formats)
    for expert_type, fmt in (("Q8_0", "gguf-q8_0"), ("IQ4_XS", "gguf-iq4_xs"), ("Q4_K_M", "gguf-mixed")):
        spec = open_model(str(gguf_models(expert_type)[0])).spec
        slots = expert_formats.format_of(spec)
        assert slots.name == fmt and slots.reads_on_cuda(spec), expert_type
    mixed, _, _ = gguf_models("Q4_K_M")
    with_q5_k = _rewritten(mixed, tmp_path / "q4_k_m_q5_k.gguf", {"blk.1.ffn_down_exps.weight": "Q5_K"})
    spec = open_model(str(with_q5_k)).spec
    assert ["Q4_K", "Q5_K"] in [list(pair) for pair in expert_formats.get("gguf-mixed").layer_types(spec)]
    assert expert_formats.format_of(spec).reads_on_cuda(spec)


# ---- a published model's shapes ------------------------------------------------------------------------------

QWEN3_30B = "tests/data/models/qwen3-30b-a3b/config.json"


def _metadata_only_qwen3_30b(path, expert_type: str = "Q8_0"):
    """Qwen3-30B-A3B's GGUF as llama.cpp writes it (its metadata keys, tensor table and types: Q8_0 matrices,
    F32 norms and routers), its tensor data left a hole of the right size (a sparse file): what `ferry plan`
    reads, without 30 GB on disk."""
    import gguf

    from ferry.plan.gguf_checkpoint import GgufNames
    from ferry.plan.model_config import parse_model_config
    from ferry.plan.model_families import family_of

    config = json.loads(open(QWEN3_30B).read())
    spec = parse_model_config(config)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(48)
    writer.add_context_length(40960)
    writer.add_embedding_length(2048)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(32)
    writer.add_head_count_kv(4)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_used_count(8)
    writer.add_key_length(128)
    writer.add_value_length(128)
    writer.add_expert_count(128)
    writer.add_expert_feed_forward_length(768)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(151936)])
    writer.add_eos_token_id(151645)
    names = GgufNames("qwen3moe", 48)
    shapes = {names.gguf_name(n): s for n, s in family_of(spec).resident_weight_shapes(spec).items()}
    for layer in range(48):
        for part, name in names.experts(layer).items():
            shapes[name] = (128, 2048, 768) if part == "down_proj" else (128, 768, 2048)
    quantized = {name: len(shape) > 1 and "ffn_gate_inp" not in name for name, shape in shapes.items()}
    _write_sparse(writer, {n: (s, expert_type if quantized[n] else "F32") for n, s in shapes.items()})
    return path


def _write_sparse(writer, tensors: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """The file's metadata and tensor table ({name: (shape, ggml type)}), its data a hole of the right size, but for
    the tensors the writer already holds (a family's generated ones, e.g. Gemma 4's rope_freqs), written first."""
    import gguf

    held = [ti.tensor for ti in writer.tensors[0].values() if ti.tensor is not None]
    assert len(held) == len(writer.tensors[0]), "a tensor the writer holds as a hole"
    data = 0
    for name, (shape, type_name) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        nbytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)))
        writer.add_tensor_info(name, shape, np.float32, nbytes, raw_dtype=qtype)
        data += writer.ggml_pad(nbytes, writer.data_alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    for values in held:
        values.tofile(fout)
        writer.write_padding(fout, values.nbytes)
    fout.truncate(fout.tell() + data)
    writer.close()


def test_a_qwen3_30b_gguf_reads_as_its_config_json_and_plans_its_experts_at_the_files_bytes(tmp_path, capsys):
    from ferry.plan.model_config import load_model_config
    from ferry.services.cli import main

    path = _metadata_only_qwen3_30b(tmp_path / "Qwen3-30B-A3B-Q8_0.gguf")
    spec, want = load_model_config(path), load_model_config(QWEN3_30B.rsplit("/", 1)[0])
    assert replace(spec, quantization=None) == want and spec.quantization.expert_format == "gguf-q8_0"
    flags = ["--gpu-memory", "24GiB", "--host-memory", "200GiB", "--json"]
    assert main(["plan", str(path), *flags]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(["plan", QWEN3_30B, *flags]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    # w13: 1536 rows of 2048 values in 64 Q8_0 blocks of 34 bytes; w2: 2048 rows of 768 values in 24 blocks
    assert plan["experts"]["bytes_per_slot"] == 1536 * 64 * 34 + 2048 * 24 * 34 == 5013504
    assert plan["host"]["expert_bank_bytes"] == 48 * 128 * 5013504
    assert plan["weights_bytes"] == bf16["weights_bytes"]  # dense tensors dequantized to bf16: as the bf16 model's
    assert plan["experts"]["slots"] > bf16["experts"]["slots"]  # 5.0 MB experts against 6.3 MB


def test_a_gguf_without_an_output_matrix_ties_lm_head_to_the_embeddings(gguf_models, tmp_path, capsys):
    """llama.cpp writes `output.weight` only when it is not the embedding matrix."""
    from safetensors.numpy import load_file, save_file

    from ferry.plan.model_config import load_model_config

    path, reference, _ = gguf_models("Q8_0")
    tied = _rewritten(path, tmp_path / "tied.gguf", {}, dropped=("output.weight",))
    assert load_model_config(tied).tie_word_embeddings and not load_model_config(path).tie_word_embeddings
    tied_reference = tmp_path / "tied-reference"
    shutil.copytree(reference, tied_reference)
    state = load_file(tied_reference / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, tied_reference / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tied_reference / "config.json").read_text())
    (tied_reference / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    assert _worst(ferry_generate(capsys, tied, *ARGS), tied_reference) < TOLERANCE


# ---- glm4moe (GLM-4.5 and its kin) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm_gguf(tmp_path_factory):
    """(a tiny glm4_moe written as a Q8_0 glm4moe GGUF, its gguf-package-decoded float32 reference, the checkpoint
    it was written from): a dense first layer, a shared expert, two expert groups, q/k/v biases, half-rotary."""
    root = tmp_path_factory.mktemp("gguf-glm")
    path, hf_dir = tiny_gguf(root, "Q8_0", arch="glm4_moe")
    return path, dequantized_reference(path, hf_dir, root / "reference"), hf_dir


def test_a_glm4moe_gguf_generates_as_transformers_on_the_decoded_file(glm_gguf, capsys):
    path, reference, _ = glm_gguf
    _served_resident_and_offloaded(capsys, path, reference, "gguf-q8_0")


def test_a_glm4moe_gguf_reads_as_the_config_it_was_written_from(glm_gguf):
    from dataclasses import fields

    from ferry.plan.model_config import load_model_config

    path, _, hf_dir = glm_gguf
    spec, want = load_model_config(path), load_model_config(hf_dir)
    assert spec.quantization.expert_format == "gguf-q8_0" and want.quantization is None
    # every field but where it came from: the GGUF's dense tensors load in bf16 unless --dtype says otherwise
    differ = {f.name for f in fields(spec) if getattr(spec, f.name) != getattr(want, f.name)}
    assert differ == {"quantization", "text_config", "dtype"}, differ
    assert spec.routed_scaling_factor == 2.5 and spec.router_groups == 2 and spec.moe_layers[0] is False


def test_a_glm4moe_gguf_counts_its_nextn_layers_out_of_the_decoder(glm_gguf):
    """llama.cpp's block_count counts the NextN (MTP) layers after the decoder's: they are not decoder layers."""
    from ferry.plan.gguf_checkpoint import open_gguf
    from ferry.plan.model_config import parse_model_config
    from ferry.plan.model_families.glm4_moe import gguf_config

    path, _, _ = glm_gguf
    ckpt = open_gguf(path)
    metadata = {**ckpt.metadata, "glm4moe.block_count": 4, "glm4moe.nextn_predict_layers": 1}
    config = gguf_config(metadata, tuple(ckpt.tensors), str(path))
    spec = parse_model_config({**config, "vocab_size": 640})
    assert config["num_hidden_layers"] == spec.num_layers == 3 and spec.mtp_layers == 1


def test_a_glm4moe_key_mapped_wrong_fails_the_comparison(glm_gguf, capsys, monkeypatch):
    """The routed scaling read from the wrong key (left at its default 1.0): the comparison must catch it."""
    from ferry.plan.model_families import glm4_moe

    path, reference, _ = glm_gguf
    fields = {k: v for k, v in glm4_moe.GGUF_FIELDS.items() if v != "routed_scaling_factor"}
    monkeypatch.setattr(glm4_moe, "GGUF_FIELDS", {**fields, "expert_group_scale": "routed_scaling_factor"})
    assert _worst(ferry_generate(capsys, path, *ARGS), reference) > TOLERANCE


def test_a_glm4moe_gguf_of_another_router_is_refused_naming_the_key(glm_gguf):
    from ferry.plan.gguf_checkpoint import open_gguf
    from ferry.plan.model_families.glm4_moe import gguf_config
    from ferry.shared.errors import ConfigError

    path, _, _ = glm_gguf
    ckpt = open_gguf(path)
    with pytest.raises(ConfigError, match="glm4moe.expert_gating_func is 1"):
        gguf_config({**ckpt.metadata, "glm4moe.expert_gating_func": 1}, tuple(ckpt.tensors), str(path))


# ---- gpt-oss -----------------------------------------------------------------------------------------------


def _redrawn_gguf(tmp_path_factory, arch: str, expert_type: str):
    """(a tiny `arch`, its weights redrawn off their initial values, written as a GGUF of `expert_type` experts, the
    file decoded by the gguf package as a float32 reference, the checkpoint it was written from)."""
    from ferry.services.gguf_writer import GGUF_SIZES
    from tests.unit.tiny_models import redrawn_tiny_checkpoint

    root = tmp_path_factory.mktemp(f"gguf-{arch}")
    hf_dir = redrawn_tiny_checkpoint(root, arch, **GGUF_SIZES)
    path, _ = tiny_gguf(root, expert_type, hf_dir=hf_dir, arch=arch)
    return path, dequantized_reference(path, hf_dir, root / "reference"), hf_dir


@pytest.fixture(scope="module")
def gpt_oss_gguf(tmp_path_factory):
    """(a tiny gpt_oss written as a gpt-oss GGUF with float32 experts and their biases, its decoded reference, the
    checkpoint it was written from): sinks, q/k/v/o biases, a sliding layer then a full one, YaRN."""
    return _redrawn_gguf(tmp_path_factory, "gpt_oss", "F32")  # nonzero expert biases and sinks


def test_a_gpt_oss_gguf_generates_as_transformers_on_the_decoded_file(gpt_oss_gguf, capsys):
    path, reference, _ = gpt_oss_gguf
    # float experts in the run dtype, biases in the rows
    _served_resident_and_offloaded(capsys, path, reference, "float32")


def test_a_gpt_oss_gguf_reads_as_the_config_it_was_written_from(gpt_oss_gguf):
    from dataclasses import fields

    from ferry.plan.model_config import load_model_config

    path, _, hf_dir = gpt_oss_gguf
    spec, want = load_model_config(path), load_model_config(hf_dir)
    differ = {f.name for f in fields(spec) if getattr(spec, f.name) != getattr(want, f.name)}
    assert differ == {"text_config", "dtype"}, differ
    assert spec.attention_windows == (8, 0) and spec.rope_yarn is not None and spec.attention_sinks


GPT_OSS_120B = "tests/data/models/gpt-oss-120b/config.json"
QWEN36_35B = "tests/data/models/qwen3.6-35b-a3b/config.json"
GEMMA4_26B = "tests/data/models/gemma-4-26b-a4b/config.json"


def _metadata_only(path, config_file: str, expert_type: str):
    """A published model as llama.cpp's converter would write its GGUF (the family's keys, the tensor table: routed
    experts in `expert_type`, their biases, routers, norms and convolutions F32, other matrices F16), the data a
    hole of the right size: what `ferry plan` reads, without the file's tens of GB."""
    import gguf

    from ferry.plan.gguf_checkpoint import GgufNames
    from ferry.plan.model_config import parse_model_config
    from ferry.plan.model_families import family_for_config
    from ferry.services.gguf_writer import common_metadata

    raw = json.loads(open(config_file).read())
    family = family_for_config(raw)
    config = {k: v for k, v in family.text_config(raw, config_file).items() if k != "quantization_config"}
    spec = parse_model_config(config)
    architecture = family.gguf_architectures[0]
    writer = gguf.GGUFWriter(str(path), architecture)
    family.gguf_write_metadata(writer, config)
    common_metadata(writer, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config["vocab_size"])])
    writer.add_eos_token_id(config["eos_token_id"] if isinstance(config["eos_token_id"], int) else 0)
    names = GgufNames(architecture, spec.num_layers)
    tensors = {}
    for name, shape in family.resident_weight_shapes(spec).items():
        shape = tuple(d for d in shape if d != 1) if len(shape) == 3 else shape  # conv1d [C, 1, K] squeezed
        gguf_name = names.gguf_name(name)
        kept = len(shape) == 1 or gguf_name.split(".")[-2] in ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d")
        tensors[gguf_name] = (shape, "F32" if kept else "F16")
    h, i = spec.hidden_size, spec.moe_intermediate_size
    for layer in spec.moe_layer_indices:
        for part, name in names.experts(layer).items():
            rows, cols = (h, i) if part == "down_proj" else (i, h)
            if name is None:  # a table of fused gate and up experts only (Gemma 4's)
                name, rows = names.fused_gate_up(layer), 2 * i
            tensors[name] = ((spec.num_experts, rows, cols), expert_type)
            if spec.expert_bias:
                bias = names.gguf_name(f"model.layers.{layer}.mlp.experts.{part}.bias")
                tensors[bias] = ((spec.num_experts, rows), "F32")
    _write_sparse(writer, tensors)
    return path


def test_the_qwen36_35b_q4_k_gguf_plans_at_24_gib_at_the_files_bytes(tmp_path, capsys):
    """Qwen3.6-35B-A3B as a qwen35moe GGUF of Q4_K experts: ~1.77 MB an expert, its plan at 24 GiB exact."""
    from ferry.services.cli import main

    path = _metadata_only(tmp_path / "Qwen3.6-35B-A3B-Q4_K.gguf", QWEN36_35B, "Q4_K")
    assert main(["plan", str(path), "--gpu-memory", "24GiB", "--host-memory", "64GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # w13: 1024 rows of 2048 values in 8 Q4_K blocks of 144 bytes; w2: 2048 rows of 512 values in 2 blocks
    w13, w2 = 1024 * 8 * 144, 2048 * 2 * 144
    assert plan["experts"]["format"] == "gguf-q4_k" and plan["experts"]["bytes_per_slot"] == w13 + w2 == 1769472
    assert plan["host"]["expert_bank_bytes"] == 40 * 256 * (w13 + w2)
    assert plan["total_bytes"] <= plan["budget_bytes"] and plan["experts"]["slots"] >= plan["experts"]["min_slots"]


def test_the_mxfp4_gpt_oss_120b_gguf_plans_at_24_gib_at_the_files_bytes(tmp_path, capsys):
    """ggml-org's gpt-oss-120b GGUF as its metadata and tensor table (MXFP4 experts, their F32 biases), the data a
    hole of the right size: `ferry plan` at 24 GiB prices each slot at the file's blocks plus the biases, the same
    bytes as openai's safetensors release (the same e2m1 codes and e8m0 scales)."""
    from ferry.services.cli import main

    path = _metadata_only(tmp_path / "gpt-oss-120b-MXFP4.gguf", GPT_OSS_120B, "MXFP4")
    assert main(["plan", str(path), "--gpu-memory", "24GiB", "--host-memory", "512GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # a row of 2880 values: 90 MXFP4 blocks of 17 bytes; then the row's float32 biases (each part at 16 bytes)
    w13, w2 = 5760 * 90 * 17 + 5760 * 4, 2880 * 90 * 17 + 2880 * 4
    assert plan["experts"]["format"] == "gguf-mxfp4" and plan["experts"]["bytes_per_slot"] == w13 + w2 == 13253760
    assert plan["host"]["expert_bank_bytes"] == 36 * 128 * (w13 + w2)
    assert plan["total_bytes"] <= plan["budget_bytes"] and plan["experts"]["slots"] >= plan["experts"]["min_slots"]


def test_a_gpt_oss_window_read_from_another_key_fails_the_comparison(gpt_oss_gguf, capsys, monkeypatch):
    """The sliding window read from the context length's key: the comparison must catch it."""
    from ferry.plan.model_families import gpt_oss

    path, reference, _ = gpt_oss_gguf
    monkeypatch.setattr(gpt_oss, "GGUF_SLIDING_WINDOW", "context_length")
    assert _worst(ferry_generate(capsys, path, *ARGS), reference) > TOLERANCE


def test_a_gpt_oss_gguf_of_mxfp4_experts_generates_as_transformers_on_the_decoded_file(
    gpt_oss_gguf, tmp_path, capsys, monkeypatch
):
    """ggml-org's gpt-oss GGUFs: MXFP4 experts beside their F32 biases, which ride in a float32 part of each slot
    row (moved with the expert) and are added before the clamped SwiGLU; offloaded equals resident."""
    import gguf

    from ferry.services.gguf_writer import write_gguf

    _, _, hf_dir = gpt_oss_gguf
    path = write_gguf(hf_dir, tmp_path / "gpt-oss-mxfp4.gguf", "MXFP4")
    biases = [t for t in gguf.GGUFReader(str(path)).tensors if t.name.endswith("_exps.bias")]
    assert len(biases) == 6 and all(np.abs(t.data).max() > 0 for t in biases)  # a path dropping them shows
    reference = dequantized_reference(path, hf_dir, tmp_path / "reference")
    _served_resident_and_offloaded(capsys, path, reference, "gguf-mxfp4")
    from ferry.services.worker.expert_formats.gguf_blocks import GgufBlockExperts

    family = GgufBlockExperts.family
    monkeypatch.setattr(
        GgufBlockExperts, "family", lambda self, rows, layout: replace(family(self, rows, layout), bias=None)
    )
    assert _worst(ferry_generate(capsys, path, *ARGS), reference) > TOLERANCE  # the biases dropped: it shows


# ---- gemma4 (Gemma 4 MoE) ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma4_gguf(tmp_path_factory):
    """(a tiny gemma4 written as a Q8_0 gemma4 GGUF, its gguf-package-decoded float32 reference, the checkpoint it
    was written from): two sliding layers and a full one of another head size, KV heads and proportional rotary
    (`rope_freqs`), K = V there, the dense MLP beside the fused experts, the router's scale and per-expert scale."""
    return _redrawn_gguf(tmp_path_factory, "gemma4", "Q8_0")  # scales and norms off their ones


def test_a_gemma4_gguf_generates_as_transformers_on_the_decoded_file(gemma4_gguf, capsys):
    path, reference, _ = gemma4_gguf
    _served_resident_and_offloaded(capsys, path, reference, "gguf-q8_0")


def test_a_gemma4_gguf_reads_as_the_config_it_was_written_from(gemma4_gguf):
    """llama.cpp's keys (the `_swa` head size and rope base, per-layer KV heads and sliding flags) and tensors
    (`rope_freqs`, a full layer without attn_v) give the checkpoint's spec; its tokenizer names the file's."""
    from dataclasses import fields

    import gguf

    from ferry.plan.model_config import load_model_config

    path, _, hf_dir = gemma4_gguf
    spec, want = load_model_config(path), load_model_config(hf_dir)
    differ = {f.name for f in fields(spec) if getattr(spec, f.name) != getattr(want, f.name)}
    assert differ == {"quantization", "text_config", "dtype"}, differ
    assert spec.attention_windows == (8, 8, 0) and spec.layer_value_is_key == (False, False, True)
    assert spec.layer_ropes[2].partial_rotary_factor == 0.25 and spec.moe_beside_dense_mlp
    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    assert {"blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale"} <= set(names)
    assert "blk.0.layer_output_scale.weight" in names and "blk.2.attn_v.weight" not in names


@pytest.mark.parametrize("fault", ["full layers turning every pair", "per-expert scale read as ones"])
def test_a_gemma4_gguf_read_wrong_fails_the_comparison(gemma4_gguf, capsys, monkeypatch, fault):
    from ferry.plan.model_families import gemma4
    from ferry.services.worker import gguf_tensors

    path, reference, _ = gemma4_gguf
    if fault == "full layers turning every pair":
        monkeypatch.setattr(gemma4, "_full_rotary_factor", lambda tensors, head_dim, where: 1.0)
    else:
        decoded = gguf_tensors.decoded
        ones = lambda t: np.ones_like(decoded(t)) if t.name.endswith("ffn_down_exps.scale") else decoded(t)  # noqa: E731
        monkeypatch.setattr(gguf_tensors, "decoded", ones)
    assert _worst(ferry_generate(capsys, path, *ARGS), reference) > TOLERANCE


def test_gemma_4_26b_a4b_as_a_q8_0_gguf_plans_at_24_gib_at_the_files_bytes(tmp_path, capsys):
    """Gemma-4-26B-A4B as llama.cpp's converter writes its GGUF (fused gate/up experts; Q8_0, whose 32-value blocks
    divide its 704-wide experts, which K blocks of 256 do not): `ferry plan` at 24 GiB prices each slot at the
    file's blocks."""
    from ferry.services.cli import main

    path = _metadata_only(tmp_path / "gemma-4-26B-A4B-Q8_0.gguf", GEMMA4_26B, "Q8_0")
    assert main(["plan", str(path), "--gpu-memory", "24GiB", "--host-memory", "64GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # w13: 2 x 704 rows of 2816 values in 88 Q8_0 blocks of 34 bytes; w2: 2816 rows of 704 values in 22 blocks
    w13, w2 = 2 * 704 * 88 * 34, 2816 * 22 * 34
    assert plan["experts"]["format"] == "gguf-q8_0" and plan["experts"]["bytes_per_slot"] == w13 + w2
    assert plan["host"]["expert_bank_bytes"] == 30 * 128 * (w13 + w2)
    assert plan["total_bytes"] <= plan["budget_bytes"] and plan["experts"]["slots"] >= plan["experts"]["min_slots"]


# ---- qwen35moe and qwen3next (Qwen3.5/3.6 MoE, Qwen3-Next: the Gated DeltaNet hybrids) ---------------------------


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def hybrid_gguf(request, tmp_path_factory):
    """(arch, a tiny hybrid written as its GGUF of Q8_0 experts, the checkpoint with what the file lost, the
    checkpoint): its weights redrawn (norms off zero, more value heads than key heads), so each of llama.cpp's
    value changes (Qwen3.5's tiled value heads, Qwen3-Next's split in_proj_qkvz, -exp(A_log), norms shifted by
    one, the squeezed convolution) shows if not undone."""
    from ferry.services.gguf_writer import GGUF_SIZES
    from tests.gguf_models import rounded_reference
    from tests.unit.tiny_models import redrawn_tiny_checkpoint

    arch = request.param
    root = tmp_path_factory.mktemp(f"gguf-{arch}")
    hf_dir = redrawn_tiny_checkpoint(root, arch, **GGUF_SIZES)
    path, _ = tiny_gguf(root, "Q8_0", hf_dir=hf_dir, arch=arch)
    return arch, path, rounded_reference(path, hf_dir, root / "reference"), hf_dir


def test_a_hybrid_gguf_generates_as_transformers_on_its_checkpoint(hybrid_gguf, capsys):
    _, path, reference, _ = hybrid_gguf
    _served_resident_and_offloaded(capsys, path, reference, "gguf-q8_0")


def test_a_hybrid_gguf_reads_as_the_config_it_was_written_from(hybrid_gguf):
    from dataclasses import fields

    from ferry.plan.model_config import load_model_config

    _, path, _, hf_dir = hybrid_gguf
    spec, want = load_model_config(path), load_model_config(hf_dir)
    differ = {f.name for f in fields(spec) if getattr(spec, f.name) != getattr(want, f.name)}
    assert differ == {"text_config", "dtype", "quantization"}, differ
    assert spec.linear_num_value_heads == 2 * spec.linear_num_key_heads and spec.layer_types == want.layer_types


FAULTS = {
    "qwen3_5_moe": ["value heads left tiled", "norms left shifted", "A left as -exp(A_log)"],
    "qwen3_next": ["in_proj_qkvz joined in the file's order", "norms left shifted", "A left as -exp(A_log)"],
}


@pytest.mark.parametrize("fault", range(3))
def test_each_hybrid_value_change_not_undone_fails_the_comparison(hybrid_gguf, capsys, monkeypatch, fault):
    from ferry.plan.model_families import qwen3_hybrid

    arch, path, reference, _ = hybrid_gguf
    fault = FAULTS[arch][fault]
    if fault == "value heads left tiled":
        monkeypatch.setattr(qwen3_hybrid, "_reorder_value_heads", lambda spec, name, values, tiled: values)
    elif fault == "in_proj_qkvz joined in the file's order":
        monkeypatch.setattr(qwen3_hybrid, "_joined_qkvz", lambda spec, qkv, z: np.concatenate([qkv, z]))
    elif fault == "norms left shifted":
        monkeypatch.setattr(qwen3_hybrid, "_shifted_norm", lambda name: False)
    else:
        monkeypatch.setattr(qwen3_hybrid, "_a_log", lambda a: a)
    assert _worst(ferry_generate(capsys, path, *ARGS), reference) > TOLERANCE


def test_a_qwen3next_gguf_of_the_first_converter_s_layout_reads_the_same(hybrid_gguf, tmp_path, capsys, monkeypatch):
    """llama.cpp's first Qwen3-Next converter wrote in_proj_qkvz whole (`ssm_in`), in the checkpoint's order."""
    from ferry.plan.model_families import qwen3_hybrid
    from ferry.services.gguf_writer import write_gguf

    arch, path, reference, hf_dir = hybrid_gguf
    if arch != "qwen3_next":
        pytest.skip("qwen3next's layouts only")
    with monkeypatch.context() as m:
        m.setattr(qwen3_hybrid, "QKVZ", "a name no tensor has")  # the writer splits nothing
        legacy = write_gguf(hf_dir, tmp_path / "legacy.gguf", "Q8_0")
    import gguf

    written = {t.name for t in gguf.GGUFReader(str(legacy)).tensors}
    assert "blk.0.ssm_in.weight" in written and "blk.0.attn_qkv.weight" not in written
    old, new = ferry_generate(capsys, legacy, *ARGS), ferry_generate(capsys, path, *ARGS)
    assert old["token_ids"] == new["token_ids"] and old["logprobs"] == new["logprobs"]


def test_a_hybrid_gguf_of_fused_gate_up_experts_reads_as_the_unfused(hybrid_gguf, tmp_path, capsys):
    """llama.cpp's converter, asked to, writes each layer's gate and up experts as one `ffn_gate_up_exps`
    [E, 2I, H] (the gate's rows first): the same blocks, so the same model, resident and offloaded."""
    import gguf

    from ferry.services.gguf_writer import write_gguf

    _, path, _, hf_dir = hybrid_gguf
    fused = write_gguf(hf_dir, tmp_path / "fused.gguf", "Q8_0", fused_gate_up=True)
    written = {t.name for t in gguf.GGUFReader(str(fused)).tensors}
    assert "blk.0.ffn_gate_up_exps.weight" in written and "blk.0.ffn_gate_exps.weight" not in written
    for extra in ((), ("--moe-cache-size", "9")):
        got, want = ferry_generate(capsys, fused, *ARGS, *extra), ferry_generate(capsys, path, *ARGS, *extra)
        assert got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"]
        assert got["plan"]["experts"]["bytes_per_slot"] == want["plan"]["experts"]["bytes_per_slot"]


def test_the_metadata_arrays_read_in_one_pass_are_the_packages_fields(tmp_path):
    """plan/gguf_checkpoint.py parses the metadata arrays itself (one pass an array, not the package's numpy calls
    per element): every field must equal the package reader's, part for part, including an empty array, arrays of
    each number width, non-ASCII and empty strings, and an array of arrays (left to the package)."""
    import gguf

    from ferry.plan.gguf_checkpoint import _reader_class

    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(2)
    w.add_token_list(["a", "", "Fähre", "渡轮", "<|im_end|>"] + [f"t{i}" for i in range(300)])
    w.add_token_types([1, 3, 1, 1, 3] + [1] * 300)
    w.add_array("test.floats", [0.5, -1.25, 1e-6])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_key_value("test.u64", [1, 2**40], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
    w.add_key_value("test.bools", [True, False], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
    w.add_tensor("x", np.arange(16, dtype=np.float32).reshape(4, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    theirs, ours = gguf.GGUFReader(str(path)), _reader_class()(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.types, mine.data, mine.contents()) == (field.types, field.data, field.contents()), name
        assert [(p.dtype, p.tobytes()) for p in mine.parts] == [(p.dtype, p.tobytes()) for p in field.parts], name
    assert ours.fields["tokenizer.ggml.tokens"].contents()[2:4] == ["Fähre", "渡轮"]
    np.testing.assert_array_equal(ours.tensors[0].data, theirs.tensors[0].data)
