"""The tiny demo checkpoint: deterministic, loadable by transformers, and consistent with its tokenizer."""

from __future__ import annotations

import json

import pytest

from ferry.plan.model_config import load_model_config
from ferry.services.make_tiny_model import make_tiny_model
from ferry.shared.eos import eos_token_ids


def test_same_seed_gives_byte_identical_checkpoint(tiny_models, tmp_path):
    again = make_tiny_model(tmp_path / "again", "qwen3_5_moe", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_models["qwen3_5_moe"] / name).read_bytes(), name


def test_other_seed_gives_other_weights(tiny_models, tmp_path):
    other = make_tiny_model(tmp_path / "other", "qwen3_moe", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_models["qwen3_moe"] / "model.safetensors").read_bytes()
    # the tokenizer does not depend on the seed
    assert (other / "tokenizer.json").read_bytes() == (tiny_models["qwen3_moe"] / "tokenizer.json").read_bytes()


def test_checkpoint_is_a_servable_moe_model(tiny_model):
    from transformers import AutoTokenizer

    spec = load_model_config(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert spec.vocab_size == len(tok)
    assert 512 <= spec.vocab_size <= 1024
    assert spec.num_experts > 1 and all(spec.moe_layers)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = json.loads((tiny_model / "generation_config.json").read_text())
    assert gen["eos_token_id"] == im_end and eos_token_ids(tiny_model, tok) == (im_end,)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.convert_ids_to_tokens(tok(special)["input_ids"]) == [special]
    if spec.arch == "qwen3_5_moe":
        assert spec.linear_attention_layers and spec.full_attention_layers


def test_tokenizer_round_trips_and_templates_chatml(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "Ferry: 12 crossings, café ☕ and\n\ttabs — any bytes round-trip."
    assert tok.decode(tok(text)["input_ids"]) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_transformers_loads_and_generates(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == load_model_config(tiny_model).vocab_size


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="--arch"):
        make_tiny_model(tmp_path / "x", "llama")


def test_cli_writes_the_same_checkpoint(tiny_models, tmp_path, capsys):
    from ferry.services.cli import main

    assert main(["make-tiny-model", str(tmp_path / "cli"), "--arch", "qwen3_moe", "--seed", "0"]) == 0
    assert "wrote a tiny qwen3_moe checkpoint" in capsys.readouterr().out
    assert (tmp_path / "cli" / "model.safetensors").read_bytes() == (
        tiny_models["qwen3_moe"] / "model.safetensors"
    ).read_bytes()
