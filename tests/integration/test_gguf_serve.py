"""A GGUF file served by `ferry serve` (issue 60): a tiny qwen3_moe, glm4_moe or gpt_oss written as llama.cpp
lays a GGUF out (tests/gguf_models.py), through the real api, scheduler and worker on CPU. The api tokenizes
the prompt with the tokenizer rebuilt from the file's metadata, and the official openai client's prompt
logprobs (echo) equal transformers' log-softmax of the same file decoded by the gguf package (float32) within
0.05, its experts offloaded (Q4_K, glm4moe's Q8_0: the file's blocks cross from the host banks) and all
resident (gpt-oss's float32 experts with their biases). Each architecture is served once: every block type,
resident and offloaded, is test_gguf_checkpoints.py's in one process, the same comparison without a boot."""

from __future__ import annotations

import openai
import pytest

from tests.gguf_models import dequantized_reference, tiny_gguf
from tests.integration.harness import REAL_WORKER_ENV, serve_model
from tests.integration.test_quantized_serve import _hf_logprobs

PROMPT = "Die Fähre bringt die Experten über das Wasser. The ferry carries the experts across the water, 渡轮."
TOLERANCE = 0.05  # the quantized Qwen tests' bound


@pytest.mark.parametrize(
    "arch, ggml_type, offload",
    [
        ("qwen3_moe", "Q4_K", ("--moe-cache-size", "9")),
        ("glm4_moe", "Q8_0", ("--moe-cache-size", "9")),
        ("gpt_oss", "F32", ()),
    ],
)
def test_served_prompt_logprobs_of_a_gguf_equal_transformers_on_the_decoded_file(tmp_path, arch, ggml_type, offload):
    from transformers import AutoTokenizer

    path, hf_dir = tiny_gguf(tmp_path / "model", ggml_type, arch=arch)
    reference = dequantized_reference(path, hf_dir, tmp_path / "reference")
    ids = AutoTokenizer.from_pretrained(hf_dir).encode(PROMPT, add_special_tokens=False)
    want = _hf_logprobs(reference, ids)
    with serve_model(path, tmp_path, REAL_WORKER_ENV, "--dtype", "float32", *offload) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
        got = r.choices[0].logprobs.token_logprobs
        assert len(got) == len(ids) and got[0] is None  # the api's tokenizer (the file's) gave the same ids
        worst = max(abs(got[p] - float(want[p - 1, ids[p]])) for p in range(1, len(ids)))
        assert worst < TOLERANCE, f"{ggml_type}: prompt logprobs off by {worst}"
        fmt = "float32" if ggml_type == "F32" else f"gguf-{ggml_type.lower()}"
        assert any(e.get("event") == "experts_loaded" and e.get("expert_format") == fmt for e in served.events())
        if arch == "gpt_oss":
            return  # its chat is harmony's framing, which the tiny tokenizer has no tokens for
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Wohin?"}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].finish_reason in ("length", "stop")
