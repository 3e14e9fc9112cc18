"""End to end on CPU: `ferry generate` (boot + executor + sampler over the paged pools) against
transformers on the same tiny checkpoint."""

from __future__ import annotations

import json

import torch

from ferry.services.cli import main


def ferry_generate(capsys, model_dir, *extra: str) -> dict:
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--gpu-memory",
        "64MiB",
        "--max-running-requests",
        "4",
        "--max-prefill-tokens",
        "64",
        "--json",
        *extra,
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "--json prints exactly one line"
    return json.loads(out[0])


def transformers_greedy(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(n):  # no cache, no eos handling: exactly argmax of the full recomputation
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt_ids) :].tolist()


def test_greedy_tokens_match_transformers(tiny_model, capsys):
    from transformers import AutoTokenizer

    prompt = "The ferry leaves the harbour at seven in the morning and"
    # a prompt longer than --max-prefill-tokens' chunk would be too; this one is prefilled in 2 chunks
    result = ferry_generate(
        capsys, tiny_model, "--prompt", prompt, "--max-tokens", "12", "--ignore-eos", "--max-prefill-tokens", "8"
    )
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert result["prompt_token_ids"] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert len(result["prompt_token_ids"]) > 8
    expected = transformers_greedy(tiny_model, result["prompt_token_ids"], 12)
    assert result["token_ids"] == expected
    assert result["text"] == tok.decode(expected, skip_special_tokens=True)
    assert result["finish_reason"] == "length"
    assert len(result["logprobs"]) == 12 and all(lp <= 0 for lp in result["logprobs"])
    assert result["plan"]["experts"]["slots"] == result["plan"]["experts"]["total"]


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny_models, capsys):
    model = tiny_models["qwen3_moe"]
    args = ("--prompt-ids", "5,6,7,8", "--max-tokens", "16", "--ignore-eos", "--temperature", "1.5")
    a = ferry_generate(capsys, model, *args, "--seed", "7")
    b = ferry_generate(capsys, model, *args, "--seed", "7")
    c = ferry_generate(capsys, model, *args, "--seed", "8")
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 16
    assert a["token_ids"] != c["token_ids"]


def test_generation_stops_at_eos(tiny_models, capsys):
    model = tiny_models["qwen3_moe"]
    greedy = ferry_generate(capsys, model, "--prompt-ids", "5,6,7", "--max-tokens", "6", "--ignore-eos")
    # make the first greedy token the eos through generation_config: the run must stop right there
    import shutil

    gen = json.loads((model / "generation_config.json").read_text())
    assert greedy["token_ids"][0] != gen["eos_token_id"]
    patched = model.parent / "eos-patched"
    if not patched.exists():
        shutil.copytree(model, patched)
    (patched / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=greedy["token_ids"][0])))
    stopped = ferry_generate(capsys, patched, "--prompt-ids", "5,6,7", "--max-tokens", "6")
    assert stopped["token_ids"] == greedy["token_ids"][:1] and stopped["finish_reason"] == "stop"


def test_dummy_weights_generate_finite_output(tiny_model, capsys):
    result = ferry_generate(
        capsys, tiny_model, "--load-format", "dummy", "--prompt-ids", "1,2,3,4", "--max-tokens", "4", "--ignore-eos"
    )
    assert len(result["token_ids"]) == 4 and all(0 <= t < 1024 for t in result["token_ids"])


def test_bad_prompt_ids_are_a_clear_error(tiny_models, capsys):
    argv = [
        "generate",
        "--model",
        str(tiny_models["qwen3_moe"]),
        "--device",
        "cpu",
        "--gpu-memory",
        "64MiB",
        "--prompt-ids",
        "1,99999",
    ]
    assert main(argv) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
