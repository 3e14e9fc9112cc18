"""Benchmark models: `ferry make-bench-model` directories, and weights whose routing behaves like a
trained model's (it changes with every token; a layer's input predicts the next layer's routing;
a skew knob makes some experts popular) — the honest workload of the decode benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ferry.plan.model_config import load_model_config, parse_model_config
from ferry.services.bench_model import cut_config, write_bench_model, write_random_weights
from ferry.services.worker.dummy_weights import iter_dummy_tensors
from ferry.services.worker.loader import open_model, resident_weights
from ferry.services.worker.models.weights import canonical_name
from tests.unit.model_harness import PagedRunner

QWEN36 = "tests/data/models/qwen3.6-35b-a3b/config.json"
MODELS = Path(__file__).resolve().parents[1] / "data/models"


def test_a_cut_config_keeps_its_per_layer_lists_consistent():
    config = json.loads(open(QWEN36).read())
    cut = cut_config(config, 8)
    text = cut["text_config"]
    assert text["num_hidden_layers"] == 8 and len(text["layer_types"]) == 8
    assert text["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["text_config"]["num_hidden_layers"] == 40  # the input is left alone
    with pytest.raises(ValueError, match="--num-layers must be in 1..40"):
        cut_config(config, 41)


def test_bench_model_directory_serves_every_id_of_the_vocabulary(tmp_path):
    out = write_bench_model(tmp_path / "m", QWEN36, num_layers=4)
    spec = load_model_config(out)
    assert spec.num_layers == 4
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == spec.vocab_size
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    ids = np.random.default_rng(0).integers(256, spec.vocab_size - 3, 50).tolist()
    assert tok.decode(ids).isascii()


def test_random_weights_load_as_a_checkpoint_and_match_the_dummy_recipe(tiny_models, tmp_path):
    out = write_bench_model(tmp_path / "r", tiny_models["qwen3_moe"] / "config.json")
    size = write_random_weights(out, dtype="float32")
    files = open_model(str(out), load_format="safetensors")
    got = dict(resident_weights(files, torch.float32, "cpu", progress=False))
    want = dict(iter_dummy_tensors(files.spec, torch.float32, "cpu", routed_experts=False))
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)
    assert size == sum(t.nbytes for t in want.values()) + sum(
        t.nbytes for _, t in iter_dummy_tensors(files.spec, torch.float32, "cpu", routed_experts=True)
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in index["weight_map"]  # the per-expert layout


def _qwen36_wrapper(tiny_models, tmp_path):
    """config.json of the tiny qwen3_5_moe wrapped as Qwen3.5/3.6's published multimodal config (text_config)."""
    text = json.loads((tiny_models["qwen3_5_moe"] / "config.json").read_text())
    wrapper = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": False,
        "text_config": {**text, "model_type": "qwen3_5_moe_text"},
    }
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    return tmp_path / "config.json"


def test_a_multimodal_wrappers_random_nvfp4_weights_carry_the_published_names_and_load(tiny_models, tmp_path):
    # Qwen3.5/3.6 (a config with text_config): `model.language_model.` as nvidia's NVFP4 releases, which FreeToken's
    # expert reader matches exactly; Ferry reads them back as the same model
    out = write_bench_model(tmp_path / "q", _qwen36_wrapper(tiny_models, tmp_path))
    write_random_weights(out, dtype="float32", fmt="nvfp4")
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    experts = [n for n in names if ".mlp.experts." in n]
    assert experts and all(n.startswith("model.language_model.layers.") for n in experts)
    assert "model.language_model.layers.0.mlp.experts.3.down_proj.weight_scale_2" in names
    assert "lm_head.weight" in names and "model.language_model.embed_tokens.weight" in names
    assert not [n for n in names if n.startswith("model.layers.")]
    excluded = json.loads((out / "config.json").read_text())["quantization_config"]["exclude_modules"]
    assert "model.language_model.layers.0.mlp.gate" in excluded
    files = open_model(str(out), load_format="safetensors")
    got = {canonical_name(n): t for n, t in resident_weights(files, torch.float32, "cpu", progress=False)}
    want = {canonical_name(n): t for n, t in iter_dummy_tensors(files.spec, torch.float32, "cpu", routed_experts=False)}
    assert got.keys() == want.keys() and torch.equal(got["embed_tokens.weight"], want["embed_tokens.weight"])


def test_random_mxfp4_weights_are_gpt_oss_blocks_on_the_routed_experts_and_load_as_mxfp4(tiny_models, tmp_path):
    # gpt-oss's MXFP4 per linear: the routed experts' weight_blocks / weight_scales, every other linear bf16 and
    # listed in modules_to_not_convert; the config reads back as mxfp4 experts
    out = write_bench_model(tmp_path / "m", tiny_models["qwen3_moe"] / "config.json")
    write_random_weights(out, dtype="float32", fmt="mxfp4")
    tensors = _checkpoint(out)
    assert tensors["model.layers.0.mlp.experts.3.down_proj.weight_blocks"].shape == (64, 1, 16)
    assert tensors["model.layers.0.mlp.experts.3.down_proj.weight_scales"].dtype == torch.uint8
    assert not [n for n in tensors if ".mlp.experts." in n and n.endswith(".weight")]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "mxfp4" and "model.layers.0.self_attn.q_proj" in qc["modules_to_not_convert"]
    assert load_model_config(out).quantization.expert_format == "mxfp4"


def _checkpoint(out):
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def test_fused_experts_are_the_per_expert_checkpoint_stacked_as_transformers_saves_them(tiny_models, tmp_path):
    # Qwen3.5/3.6's published bf16 layout: a layer's experts as gate_up_proj [E, 2I, H] and down_proj [E, H, I]
    config = _qwen36_wrapper(tiny_models, tmp_path)
    per_expert = write_bench_model(tmp_path / "p", config)
    fused = write_bench_model(tmp_path / "f", config)
    size_p = write_random_weights(per_expert, dtype="float32")
    size_f = write_random_weights(fused, dtype="float32", expert_layout="fused")
    assert size_p == size_f
    p, f = _checkpoint(per_expert), _checkpoint(fused)
    spec = load_model_config(fused)
    e, i = spec.num_experts, spec.moe_intermediate_size
    assert not [n for n in f if ".mlp.experts." in n and not n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for layer in spec.moe_layer_indices:
        base = f"model.language_model.layers.{layer}.mlp.experts"
        gate_up, down = f[base + ".gate_up_proj"], f[base + ".down_proj"]
        assert gate_up.shape == (e, 2 * i, spec.hidden_size) and down.shape == (e, spec.hidden_size, i)
        for x in (0, e - 1):
            assert torch.equal(gate_up[x, :i], p[f"{base}.{x}.gate_proj.weight"])
            assert torch.equal(gate_up[x, i:], p[f"{base}.{x}.up_proj.weight"])
            assert torch.equal(down[x], p[f"{base}.{x}.down_proj.weight"])

    class _State:
        def __init__(self, tensors):
            self.tensors = tensors

        def state_dict(self):
            return self.tensors

    prompt = np.random.default_rng(2).integers(0, spec.vocab_size, 24).tolist()
    logits = [PagedRunner(spec, _State(t), page_size=16).step([(1, prompt)]) for t in (p, f)]
    assert torch.equal(logits[0][0], logits[1][0])  # Ferry reads both layouts as the same model


def test_a_fused_layout_of_quantized_experts_is_refused_where_the_family_publishes_none(tiny_models, tmp_path):
    out = write_bench_model(tmp_path / "q", _qwen36_wrapper(tiny_models, tmp_path))
    with pytest.raises(ValueError, match="publishes no fused layout of quantized experts"):
        write_random_weights(out, dtype="float32", fmt="nvfp4", expert_layout="fused")
    assert not list(out.glob("*.safetensors"))  # refused before any weight was drawn


def test_the_command_refuses_skew_without_weights(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferry.services.cli",
            "make-bench-model",
            str(tmp_path / "x"),
            "--config",
            QWEN36,
            "--routing-skew",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--routing-skew needs --weights random" in done.stderr


SPEC = parse_model_config(
    {
        "model_type": "qwen3_moe",
        "vocab_size": 512,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 64,
        "intermediate_size": 256,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
        "norm_topk_prob": True,
    }
)


def _routing(skew: float, tokens: int = 64):
    """Per MoE layer: the router's input and the routed ids of every prompt token (dummy weights)."""
    weights = {}
    for routed in (False, True):
        weights.update(iter_dummy_tensors(SPEC, torch.float32, "cpu", routed, routing_skew=skew))

    class _State:
        def state_dict(self):
            return weights

    runner = PagedRunner(SPEC, _State(), page_size=16)
    seen = []
    for layer in runner.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, args, out: seen.append((args[0].clone(), out[0].clone())))
    prompt = np.random.default_rng(1).integers(0, SPEC.vocab_size, tokens).tolist()
    runner.step([(1, prompt)])
    return seen, [layer.mlp.gate.weight for layer in runner.model.layers]


def test_dummy_routing_changes_with_every_token_and_the_next_layer_is_predictable():
    seen, routers = _routing(skew=0.0)
    for layer, (x, ids) in enumerate(seen):
        sets = [set(r.tolist()) for r in ids]
        overlap = np.mean([len(a & b) / 4 for a, b in zip(sets, sets[1:])])
        assert overlap < 0.4, f"layer {layer}: consecutive tokens share {overlap:.0%} of their experts"
        assert len(set().union(*sets)) == SPEC.num_experts  # every expert is used by someone
        if layer + 1 < len(seen):  # the next router on this layer's input predicts the next layer
            predicted = torch.topk(x @ routers[layer + 1].T, 4, dim=-1).indices
            actual = seen[layer + 1][1]
            hit = np.mean([len(set(p.tolist()) & set(a.tolist())) / 4 for p, a in zip(predicted, actual)])
            assert hit > 0.75, f"layer {layer + 1} predicted at {hit:.0%}"


def test_routing_skew_makes_experts_popular():
    counts = {}
    for skew in (0.0, 2.0):
        seen, _ = _routing(skew=skew, tokens=128)
        ids = seen[0][1].reshape(-1)
        counts[skew] = np.sort(np.bincount(ids.numpy(), minlength=SPEC.num_experts))[::-1]
    top4_share = {s: c[:4].sum() / c.sum() for s, c in counts.items()}
    assert top4_share[0.0] < 0.3 < 0.5 < top4_share[2.0], top4_share


# ---- --format gguf-TYPE: the model as one GGUF file of random blocks -------------------------------------------

GGUF_ARGS = ("--max-tokens", "6", "--ignore-eos", "--dtype", "float32", "--temperature", "0")
GGUF_PROMPT = ",".join(str((i * 37 + 11) % 200) for i in range(24))


@pytest.fixture(scope="module")
def gguf_bench_config(tiny_models, tmp_path_factory):
    """The tiny qwen3_moe's config.json at GGUF's sizes (rows of whole K blocks), as a published config."""
    from ferry.services.gguf_writer import GGUF_SIZES

    config = json.loads((tiny_models["qwen3_moe"] / "config.json").read_text())
    config.update(GGUF_SIZES)
    path = tmp_path_factory.mktemp("gguf-bench-config") / "config.json"
    path.write_text(json.dumps(config))
    return path


def _make_gguf_bench(out, config, fmt: str, *extra: str) -> int:
    from ferry.services.cli import main

    return main(["make-bench-model", str(out), "--config", str(config), "--format", fmt, *extra])


def test_a_q4_k_m_bench_cut_is_one_gguf_file_that_plans_and_generates_resident_and_offloaded(
    gguf_bench_config, tmp_path, capsys
):
    from ferry.services.cli import main
    from tests.unit.test_generate_e2e import ferry_generate

    out = tmp_path / "q4km"
    assert _make_gguf_bench(out, gguf_bench_config, "gguf-q4_k_m", "--num-layers", "2", "--weights", "random") == 0
    assert f"serve it with --model {out}" in capsys.readouterr().out
    assert [p.name for p in out.iterdir()] == ["model-Q4_K_M.gguf"]  # alone: --model DIR finds it
    spec = load_model_config(out)
    # llama-quantize's mix over 2 blocks: down Q6_K on the last
    assert spec.num_layers == 2 and spec.quantization.expert_types == (("Q4_K", "Q4_K"), ("Q4_K", "Q6_K"))
    assert main(["plan", str(out), "--gpu-memory", "24GiB", "--host-memory", "8GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["experts"]["format"] == "gguf-mixed"
    resident = ferry_generate(capsys, out, "--prompt-ids", GGUF_PROMPT, *GGUF_ARGS)
    assert len(resident["token_ids"]) == 6 and all(np.isfinite(resident["logprobs"]))
    offloaded = ferry_generate(capsys, out, "--prompt-ids", GGUF_PROMPT, *GGUF_ARGS, "--moe-cache-size", "8")
    assert offloaded["expert_cache"]["misses"] > 0
    assert offloaded["token_ids"] == resident["token_ids"] and offloaded["logprobs"] == resident["logprobs"]


def test_a_gemma4_bench_cut_of_a_multimodal_config_is_a_gguf_that_plans_and_generates(tmp_path, capsys):
    """Gemma 4's published config wraps the text model (`text_config`, tensors under `language_model.`): the GGUF
    of its cut holds the text model alone, named as llama.cpp's converter names it, and serves resident and
    offloaded."""
    from ferry.services.cli import main
    from ferry.services.gguf_writer import GGUF_SIZES
    from ferry.services.make_tiny_model import make_tiny_model
    from tests.unit.test_generate_e2e import ferry_generate

    text = json.loads((make_tiny_model(tmp_path / "tiny", "gemma4") / "config.json").read_text())
    text.update(GGUF_SIZES)
    wrapper = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
    (config := tmp_path / "config.json").write_text(json.dumps(wrapper))
    out = tmp_path / "gemma4"
    assert _make_gguf_bench(out, config, "gguf-q8_0", "--weights", "random") == 0
    spec = load_model_config(out)
    assert spec.arch == "gemma4" and spec.num_layers == 3 and spec.quantization.expert_format == "gguf-q8_0"
    assert main(["plan", str(out), "--gpu-memory", "24GiB", "--host-memory", "8GiB", "--json"]) == 0
    capsys.readouterr()
    resident = ferry_generate(capsys, out, "--prompt-ids", GGUF_PROMPT, *GGUF_ARGS)
    assert len(resident["token_ids"]) == 6 and all(np.isfinite(resident["logprobs"]))
    offloaded = ferry_generate(capsys, out, "--prompt-ids", GGUF_PROMPT, *GGUF_ARGS, "--moe-cache-size", "8")
    assert offloaded["expert_cache"]["misses"] > 0
    assert offloaded["token_ids"] == resident["token_ids"] and offloaded["logprobs"] == resident["logprobs"]


@pytest.mark.parametrize("fmt", ["gguf-q8_0", "gguf-q4_k", "gguf-mxfp4"])
def test_a_gguf_bench_models_experts_are_valid_blocks_of_the_dummy_spread_under_the_recipes_router(
    gguf_bench_config, tmp_path, fmt
):
    """Every routed expert tensor decodes (by the gguf package) to finite values of the dummy experts' spread (down
    ten times weaker), in the one type asked; the router is the dummy recipe's, kept float32 as llama.cpp keeps it."""
    import gguf

    from ferry.services.worker.dummy_weights import LINEAR_STD, OUTPUT_STD, dummy_tensor

    out = tmp_path / fmt
    assert _make_gguf_bench(out, gguf_bench_config, fmt, "--weights", "random", "--seed", "3") == 0
    spec = load_model_config(out)
    assert spec.quantization.expert_format == fmt
    reader = gguf.GGUFReader(str(out / f"model-{fmt[5:].upper()}.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    for layer in spec.moe_layer_indices:
        for part, std in (("gate", LINEAR_STD), ("up", LINEAR_STD), ("down", OUTPUT_STD)):
            t = tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
            assert t.tensor_type.name == fmt[5:].upper()
            values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            assert np.isfinite(values).all() and 0.5 * std < float(values.std()) < 2 * std, (layer, part)
        router, shape = tensors[f"blk.{layer}.ffn_gate_inp.weight"], (spec.num_experts, spec.hidden_size)
        want = dummy_tensor(spec, f"model.layers.{layer}.mlp.gate.weight", shape, torch.float32, "cpu", seed=3)
        assert router.tensor_type.name == "F32"
        assert np.array_equal(np.asarray(router.data).reshape(want.shape), want.numpy())


@pytest.mark.parametrize("fmt", ["gguf-q4_k_m", "gguf-mxfp4"])
def test_a_gguf_of_holes_plans_as_the_one_of_random_blocks_in_no_disk(gguf_bench_config, tmp_path, capsys, fmt):
    """--weights none writes the GGUF's whole tensor table and leaves its data a hole (a sparse file, zeros when
    read): its plan is the random file's, byte for byte, and the file takes a fraction of its size on disk, so a
    full-size GGUF (gpt-oss-120b's 61 GiB) plans on any machine."""
    import gguf

    from ferry.services.cli import main

    plans, files = {}, {}
    for weights in ("random", "none"):
        out = tmp_path / weights
        assert _make_gguf_bench(out, gguf_bench_config, fmt, "--weights", weights) == 0
        said = capsys.readouterr().out
        assert ("of holes" in said and "ferry plan --model" in said) == (weights == "none"), said
        (files[weights],) = out.iterdir()
        assert main(["plan", str(out), "--gpu-memory", "24GiB", "--host-memory", "8GiB", "--json"]) == 0
        plans[weights] = json.loads(capsys.readouterr().out)
        plans[weights].pop("model", None)
    assert plans["none"] == plans["random"]
    holes, random = files["none"], files["random"]
    assert holes.stat().st_size == random.stat().st_size
    assert holes.stat().st_blocks * 512 < random.stat().st_size / 4
    read, want = gguf.GGUFReader(str(holes)), gguf.GGUFReader(str(random))
    assert [(t.name, t.tensor_type, t.data_offset) for t in read.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in want.tensors
    ]
    assert not any(np.asarray(t.data).any() for t in read.tensors)  # every byte reads as zero


@pytest.mark.parametrize(
    "config, fmt, slots",
    [("qwen3.6-35b-a3b", "gguf-q4_k_m", (8000, 10240)), ("gpt-oss-120b", "gguf-mxfp4", (1200, 4608))],
)
def test_the_full_size_gguf_plans_at_24_gib(tmp_path, capsys, config, fmt, slots):
    """Issue 60's full-size plans, from files of holes of the published configs: they fit a 24 GiB card with most
    of Qwen3.6-35B-A3B's Q4_K_M experts and a quarter of gpt-oss-120b's MXFP4 ones in slots (README's figures)."""
    from ferry.services.cli import main

    out = tmp_path / config
    assert _make_gguf_bench(out, MODELS / config / "config.json", fmt) == 0
    capsys.readouterr()
    assert main(["plan", str(out), "--gpu-memory", "24GiB", "--host-memory", "128GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    experts = plan["experts"]
    assert experts["format"] == ("gguf-mixed" if fmt == "gguf-q4_k_m" else fmt)
    assert slots[0] <= experts["slots"] < experts["total"] == slots[1], experts


def test_a_gguf_bench_model_needs_a_directory_of_its_own(gguf_bench_config, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "config.json").write_text("{}")
    assert _make_gguf_bench(taken, gguf_bench_config, "gguf-q8_0", "--weights", "random") == 2
    assert "is not empty" in capsys.readouterr().err


def test_a_gpt_oss_bench_model_has_gpt_oss_tokenizer_so_the_api_serves_it_with_harmony(tmp_path):
    """gpt-oss's models speak harmony, whose chat format refuses any tokenizer but o200k_harmony: the bench model
    gets that one (every id of the config's vocabulary decodes, <|return|> its end of reply), not the printable
    one, so `ferry serve` takes it at its defaults."""
    from transformers import AutoTokenizer

    from ferry.services.api.harmony_format import check_tokenizer, harmony_encoding

    out = write_bench_model(tmp_path / "g", "tests/data/models/gpt-oss-120b/config.json", 2)
    tok = AutoTokenizer.from_pretrained(out)
    check_tokenizer(harmony_encoding(), tok, str(out))
    config = json.loads((out / "config.json").read_text())
    assert len(tok) == config["vocab_size"] and tok.decode([config["vocab_size"] - 1])
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|return|>")
    qwen = write_bench_model(tmp_path / "q", "tests/data/models/qwen3-30b-a3b/config.json", 2)
    with pytest.raises(Exception, match="not a gpt-oss tokenizer"):
        check_tokenizer(harmony_encoding(), AutoTokenizer.from_pretrained(qwen), str(qwen))
