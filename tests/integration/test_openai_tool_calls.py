"""The OpenAI chat route reads the model's reasoning and Qwen-format tool calls (tool_choice auto), with the
official `openai` client, against the real api and scheduler and the PagedHashModel double whose output
for prompts about the weather is a fixed script: `<think>` reasoning, a sentence, a `<tool_call>` block.
Plain and streamed: `reasoning_content`, `content` and `tool_calls` (as OpenAI's tool-call deltas);
`separate_reasoning: false` leaves the reasoning in the content; a `tool` message answers the call."""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.harness import make_model_dir, start_cluster
from tests.integration.test_anthropic_messages import SCRIPT, script_ids

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_tokenizer_dir, tiny_tokenizer, tmp_path_factory):
    script = {"trigger": "weather", "token_ids": script_ids(tiny_tokenizer)}
    model = make_model_dir(
        tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "scripted-openai", tiny_tokenizer, script=script
    )
    c = start_cluster(model, tmp_path_factory.mktemp("openai-tools"), worker_flags=["--max-model-len", "1024"])
    yield openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    c.stop()


def test_tool_call_and_reasoning_not_streamed(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me check."
    assert c.message.reasoning_content == "The user asks about the weather."
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_tool_call_and_reasoning_streamed_as_deltas(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert reasoning == "The user asks about the weather." and content == "Let me check."
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_separate_reasoning_off_and_tool_choice_none_leave_the_text_as_written(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=200,
        extra_body={"separate_reasoning": False},
    )
    text = SCRIPT.removesuffix("<|im_end|>")
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_a_tool_message_answers_the_call(client):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=5)
    assert r.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model="tiny", messages=ASK + [{"role": "tool", "content": "x"}], max_tokens=2)
