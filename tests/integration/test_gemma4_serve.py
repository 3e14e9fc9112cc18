"""Gemma 4 MoE served by `ferry serve` (issue 59): a tiny gemma4 checkpoint (`ferry make-tiny-model --arch gemma4`:
two sliding layers, then a full one with its own head size, one KV head that is both K and V, proportional rotary,
a dense MLP beside the experts, soft-capped logits; its weights redrawn so no scale sits at 1) through the real
api, scheduler and worker on CPU. The official openai client's prompt logprobs (echo) equal transformers'
log-softmax of the same checkpoint (float32) within the Qwen tests' 1e-4 (test_openai_features.py), every expert
resident and offloaded (fewer slots than experts), and a chat turn through the checkpoint's template ends. A forced
tool call (tool_choice required) is written in Gemma 4's own markup, the family's (`<|tool_call>call:NAME{...}`,
services/api/gemma4_format.py), and read back into the client's tool_calls."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.harness import REAL_WORKER_ENV, serve_model
from tests.integration.test_quantized_serve import _hf_logprobs
from tests.unit.tiny_models import redrawn_tiny_checkpoint

PROMPT = " ".join(["The ferry carries the experts across the water"] * 6)  # several times the window (8)
TOLERANCE = 1e-4  # float32 prompt logprobs against transformers, as the Qwen tests hold them


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return redrawn_tiny_checkpoint(tmp_path_factory.mktemp("gemma4"), "gemma4")


@pytest.mark.parametrize("offload", [(), ("--moe-cache-size", "9")], ids=["resident", "offloaded"])
def test_served_prompt_logprobs_equal_transformers(checkpoint, tmp_path, offload):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(checkpoint).encode(PROMPT, add_special_tokens=False)
    want = _hf_logprobs(checkpoint, ids)
    with serve_model(checkpoint, tmp_path, REAL_WORKER_ENV, "--dtype", "float32", *offload) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
        got = r.choices[0].logprobs.token_logprobs
        assert len(got) == len(ids) > 3 * 8 and got[0] is None
        worst = max(abs(got[p] - float(want[p - 1, ids[p]])) for p in range(1, len(ids)))
        assert worst < TOLERANCE, f"prompt logprobs off by {worst}"
        plan = next(e for e in served.events() if e.get("event") == "plan")
        assert (plan["expert_slots"] < plan["expert_total"]) == bool(offload)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Where to?"}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].finish_reason in ("length", "stop")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}


def test_served_forced_tool_call_is_written_in_gemma4_markup_and_read_into_tool_calls(checkpoint, tmp_path):
    with serve_model(checkpoint, tmp_path, REAL_WORKER_ENV, "--dtype", "float32") as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=64,
            temperature=0,
            logprobs=True,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and args["unit"] in ("c", "f") and len(args["city"]) <= 12
        written = "".join(t.token for t in choice.logprobs.content)
        assert written.startswith('<|tool_call>call:get_weather{city:<|"|>') and "}<tool_call|>" in written
