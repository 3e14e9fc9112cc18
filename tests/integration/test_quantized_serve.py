"""Quantized checkpoints served by `ferry serve` (issue 21): a tiny checkpoint of each architecture in each
published layout (tests/quantized_models.py: nvidia modelopt NVFP4, compressed-tensors NVFP4 made by
compressed-tensors itself, Qwen's FP8 blocks, gpt-oss's MXFP4 per linear), through the real api,
scheduler and worker on CPU, the official openai client asking for prompt logprobs (echo): they equal
transformers' log-softmax of the same checkpoint dequantized (float32) within 0.05. Half of them run
offloaded (fewer expert slots than experts: the quantized rows cross from the host banks), and the worker's
log names the format. Each layout is served once, on one architecture: every architecture in every layout,
resident and offloaded, is test_quantized_checkpoints.py's (in one process, the same comparison); a boot of
the three services is what this file adds, and each costs more than all of that file's cases of a layout."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import TINY_ARCHS
from tests.integration.harness import REAL_WORKER_ENV, serve_model
from tests.quantized_models import LAYOUT_FORMATS, LAYOUTS, dequantized_copy

PROMPT = " ".join(["The ferry carries the experts across the water"] * 6)
TOLERANCE = 0.05  # activations stay float32 here (W4A16, W8A16): the bound for NVFP4 holds both


def _hf_logprobs(model_dir, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


# (architecture, layout, offloaded): both architectures, both resident and offloaded, each layout
SERVED = [
    ("qwen3_5_moe", "modelopt-nvfp4", True),
    ("qwen3_moe", "ct-nvfp4", False),
    ("qwen3_5_moe", "fp8", False),
    ("qwen3_moe", "mxfp4", True),
]


def test_the_served_cases_cover_every_layout_both_architectures_and_both_placements():
    assert sorted(layout for _, layout, _ in SERVED) == sorted(LAYOUTS)
    assert {arch for arch, _, _ in SERVED} == set(TINY_ARCHS) and {o for _, _, o in SERVED} == {True, False}


@pytest.mark.parametrize("arch, layout, offloaded", SERVED)
def test_served_prompt_logprobs_equal_transformers_on_the_dequantized_weights(
    quantized_tiny_models, tmp_path, arch, layout, offloaded
):
    from transformers import AutoTokenizer

    model = quantized_tiny_models(arch, layout)
    reference = dequantized_copy(model, tmp_path / "dequantized")
    ids = AutoTokenizer.from_pretrained(model).encode(PROMPT, add_special_tokens=False)
    want = _hf_logprobs(reference, ids)
    offload = ("--moe-cache-size", "9") if offloaded else ()
    with serve_model(model, tmp_path, REAL_WORKER_ENV, "--dtype", "float32", *offload) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
        got = r.choices[0].logprobs.token_logprobs
        assert len(got) == len(ids) and got[0] is None
        worst = max(abs(got[p] - float(want[p - 1, ids[p]])) for p in range(1, len(ids)))
        assert worst < TOLERANCE, f"{layout} {arch}: prompt logprobs off by {worst}"
        fmt = LAYOUT_FORMATS[layout]
        assert any(e.get("event") == "experts_loaded" and e.get("expert_format") == fmt for e in served.events())
