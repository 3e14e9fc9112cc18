"""The harmony chat format (gpt-oss) served: the real api and scheduler with the PagedHashModel double as the
worker, a gpt-oss tokenizer (o200k_harmony: tests/doubles/harmony_tokenizer.py) whose chat template writes
harmony's framing, so `--chat-format auto` picks harmony. Prompts that mention the weather get a fixed output
that harmony's own renderer wrote: an analysis message, a commentary preamble to the user and a call to
functions.get_weather, ending in <|call|>. Through the official `openai` and `anthropic` clients, streamed and
not, the OpenAI chat route, the Anthropic Messages route and the Responses route must make reasoning, text
and a tool call of it; the prompt the api sends is harmony's rendering of the conversation."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from transformers import AutoTokenizer

from tests.integration.harness import make_model_dir, start_cluster

REASONING = "The user asks about the weather in Paris."
PREAMBLE = "Let me check."
ARGUMENTS = {"city": "Paris", "unit": "celsius"}
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city"],
}
ASK = "What is the weather in Paris?"
# a chat template in harmony's framing (a gpt-oss checkpoint's writes <|channel|> and <|message|>): what `auto` reads
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "<|start|>assistant<|channel|>final<|message|>"
)


def script_messages():
    from openai_harmony import Message, Role

    return [
        Message.from_role_and_content(Role.ASSISTANT, REASONING).with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, PREAMBLE).with_channel("commentary"),
        Message.from_role_and_content(Role.ASSISTANT, json.dumps(ARGUMENTS))
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
    ]


def script_ids(encoding) -> list[int]:
    """What the model writes after the prompt's `<|start|>assistant`: harmony's rendering of the messages, the
    first's `<|start|>assistant` left out, the call ending the output."""
    ids: list[int] = []
    for message in script_messages():
        ids += encoding.render(message)
    assert ids[:2] == encoding.encode("<|start|>assistant", allowed_special="all")
    return ids[2:]


@pytest.fixture(scope="module")
def encoding():
    from ferry.services.api.harmony_format import harmony_encoding

    return harmony_encoding()


@pytest.fixture(scope="module")
def served(harmony_tokenizer_dir, encoding, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(str(harmony_tokenizer_dir))
    tokenizer.chat_template = HARMONY_TEMPLATE
    directory = tmp_path_factory.mktemp("harmony-tokenizer-templated")
    tokenizer.save_pretrained(str(directory))
    script = {"trigger": "weather", "token_ids": script_ids(encoding)}
    model = make_model_dir(directory, tmp_path_factory.mktemp("models") / "harmony", tokenizer, script=script)
    c = start_cluster(model, tmp_path_factory.mktemp("harmony"), worker_flags=["--max-model-len", "2048"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served.base_url, api_key="x", max_retries=0, timeout=60)


CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS}}
]


def test_chat_not_streamed(oai):
    out = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, reasoning_effort="high"
    )
    choice = out.choices[0]
    assert choice.message.reasoning_content == REASONING
    assert choice.message.content == PREAMBLE
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGUMENTS)
    assert choice.finish_reason == "tool_calls"


def test_chat_streamed(oai):
    stream = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": ASK}], tools=CHAT_TOOLS, stream=True
    )
    reasoning, content, calls, reasons = "", "", [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        reasons.append(chunk.choices[0].finish_reason)
    assert (reasoning, content) == (REASONING, PREAMBLE)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", ARGUMENTS)]
    assert reasons[-1] == "tool_calls"


def test_the_prompt_is_harmonys_rendering(oai, encoding, served):
    """usage.prompt_tokens is the length of harmony's rendering of the conversation (its system message, the
    developer message with the instructions and the tool, the turn)."""
    from openai_harmony import Conversation, DeveloperContent, Message, Role, ToolDescription

    from ferry.services.api.harmony_format import HarmonyChat

    chat = HarmonyChat(AutoTokenizer.from_pretrained(str(served.model_dir)), "test")
    out = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        tools=CHAT_TOOLS,
        reasoning_effort="low",
    )
    developer = (
        DeveloperContent.new()
        .with_instructions("Be brief.")
        .with_function_tools([ToolDescription.new("get_weather", "Weather", PARAMETERS)])
    )
    conversation = Conversation.from_messages(
        [
            chat._system("low"),
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, ASK),
        ]
    )
    expected = encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
    assert out.usage.prompt_tokens == len(expected)


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": PARAMETERS}]


def blocks(content) -> list[tuple]:
    out = []
    for b in content:
        if b.type == "thinking":
            out.append(("thinking", b.thinking))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append(("tool_use", b.name, b.input))
    return out


EXPECTED_BLOCKS = [("thinking", REASONING), ("text", PREAMBLE), ("tool_use", "get_weather", ARGUMENTS)]


def test_anthropic_not_streamed(claude):
    msg = claude.messages.create(
        model="tiny",
        max_tokens=300,
        tools=ANTHROPIC_TOOLS,
        messages=[{"role": "user", "content": ASK}],
        thinking={"type": "enabled", "budget_tokens": 2048},
    )
    assert blocks(msg.content) == EXPECTED_BLOCKS and msg.stop_reason == "tool_use"


def test_anthropic_streamed(claude):
    with claude.messages.stream(
        model="tiny", max_tokens=300, tools=ANTHROPIC_TOOLS, messages=[{"role": "user", "content": ASK}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert blocks(final.content) == EXPECTED_BLOCKS and final.stop_reason == "tool_use"
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": PARAMETERS}]


def items(output) -> list[tuple]:
    out = []
    for item in output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", item.name, json.loads(item.arguments)))
    return out


EXPECTED_ITEMS = [("reasoning", REASONING), ("message", PREAMBLE), ("function_call", "get_weather", ARGUMENTS)]


def test_responses_not_streamed(oai):
    response = oai.responses.create(model="tiny", input=ASK, tools=RESPONSES_TOOLS, reasoning={"effort": "medium"})
    assert items(response.output) == EXPECTED_ITEMS and response.status == "completed"


def test_responses_streamed(oai):
    with oai.responses.stream(model="tiny", input=ASK, tools=RESPONSES_TOOLS) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert items(final.output) == EXPECTED_ITEMS
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
