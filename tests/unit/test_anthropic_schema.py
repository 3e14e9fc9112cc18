"""The Anthropic request body as the chat template and the sampler see it (no server needed)."""

from __future__ import annotations

import msgspec
import pytest

from ferry.services.api import anthropic_schema as schema
from ferry.services.api.anthropic_responses import MessageBuilder, error_body
from ferry.services.api.anthropic_routes import forced_prompt_suffix
from ferry.services.api.generation import Usage
from ferry.services.api.output_parsers import Reasoning, Text, ToolCall
from ferry.shared.errors import InvalidRequest


def request(**fields) -> schema.MessagesRequest:
    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=schema.MessagesRequest)


def test_conversation_with_tool_use_and_results_becomes_template_messages():
    req = request(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Weather?", "cache_control": {"type": "ephemeral"}},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "P"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "rain", "is_error": True},
                ],
            },
        ],
    )
    assert schema.template_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "use the tool",
            "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "w", "arguments": {"c": "P"}}}],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "rain"},
    ]


def test_tools_and_choices():
    tool = {
        "name": "w",
        "description": "weather",
        "input_schema": {"type": "object", "properties": {"c": {"type": "string"}}},
    }
    req = request(tools=[tool])
    assert schema.template_tools(req) == [
        {"type": "function", "function": {"name": "w", "description": "weather", "parameters": tool["input_schema"]}}
    ]
    assert schema.tool_schemas(req) == {"w": tool["input_schema"]}
    assert schema.tool_schemas(request(tools=[tool], tool_choice={"type": "none"})) is None  # no call may be parsed
    assert schema.template_tools(request(tools=[tool], tool_choice={"type": "none"})) is None  # nor is one offered
    assert schema.template_kwargs(req) == {}  # the template's own default
    assert schema.template_kwargs(request(thinking={"type": "disabled"})) == {"enable_thinking": False}
    assert schema.template_kwargs(request(thinking={"type": "enabled", "budget_tokens": 1024})) == {
        "enable_thinking": True,
        "reasoning_effort": "low",  # gpt-oss's templates read it
    }
    efforts = [schema.thinking_effort(budget) for budget in (1024, 4095, 4096, 16383, 16384, 64000)]
    assert efforts == ["low", "low", "medium", "medium", "high", "high"]
    assert schema.template_kwargs(request(thinking={"type": "adaptive"})) == {"enable_thinking": True}
    assert schema.template_kwargs(request(tools=[tool], tool_choice={"type": "any"})) == {"enable_thinking": False}
    with pytest.raises(InvalidRequest, match="thinking may not be enabled"):
        schema.template_kwargs(request(tools=[tool], tool_choice={"type": "any"}, thinking={"type": "enabled"}))
    with pytest.raises(InvalidRequest, match="Anthropic's own tools"):
        schema.template_tools(request(tools=[{"type": "web_search_20250305", "name": "web_search"}]))
    with pytest.raises(InvalidRequest, match="not one of the tools"):
        schema.template_tools(request(tools=[tool], tool_choice={"type": "tool", "name": "x"}))


def test_forced_tool_choices_name_the_tools_the_grammar_holds_the_output_to():
    w = {"name": "w", "input_schema": {"type": "object", "properties": {"c": {"type": "string"}}}}
    t = {"name": "t"}  # no input_schema: any object
    assert schema.forced_tools(request(tools=[w, t])) is None  # auto: the model's own markup is parsed
    assert schema.forced_tools(request(tools=[w, t], tool_choice={"type": "auto"})) is None
    assert schema.forced_tools(request(tools=[w, t], tool_choice={"type": "any"})) == [
        ("w", w["input_schema"]),
        ("t", {"type": "object"}),
    ]
    assert schema.forced_tools(request(tools=[w, t], tool_choice={"type": "tool", "name": "t"})) == [
        ("t", {"type": "object"})
    ]
    assert schema.parallel_calls(request(tools=[w], tool_choice={"type": "any"}))
    assert not schema.parallel_calls(request(tools=[w], tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    for kind in ("any", "tool"):
        with pytest.raises(InvalidRequest, match="need tools"):
            schema.template_tools(request(tool_choice={"type": kind, "name": "w"}))
    assert schema.template_tools(request(tool_choice={"type": "auto"})) is None


def test_a_forced_call_closes_a_reasoning_the_template_always_opens():
    forced = request(tools=[{"name": "w"}], tool_choice={"type": "any"})
    assert forced_prompt_suffix(forced, "<|im_start|>assistant\n") == ""  # the grammar opens the call itself
    assert forced_prompt_suffix(forced, "assistant\n<think>\n") == "</think>\n\n"
    assert forced_prompt_suffix(request(tools=[{"name": "w"}]), "assistant\n<think>\n") == ""  # auto: the model thinks


def test_sampling_and_validation():
    p = schema.sampling_params(request(temperature=0.5, top_p=0.8, top_k=3), (7,))
    assert (p.temperature, p.top_p, p.top_k, p.stop_token_ids) == (0.5, 0.8, 3, (7,))
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"stop_sequences": [""]}):
        with pytest.raises(InvalidRequest):
            schema.validate(request(**bad))
    with pytest.raises(InvalidRequest, match="text-only"):
        schema.template_messages(request(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]))
    with pytest.raises(InvalidRequest, match="belongs in a user turn"):
        schema.template_messages(
            request(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}])
        )


def test_message_builder_blocks_events_and_stop_reasons():
    b = MessageBuilder("m")
    start = b.start(12)
    assert [e["type"] for e in start] == ["message_start", "ping"] and start[0]["message"]["usage"][
        "input_tokens"
    ] == 12
    events = b.apply([Reasoning("hm"), Reasoning(" ok"), Text("\n"), Text("Hi"), ToolCall("w", {"c": 1}), Text("\n")])
    assert [(e["type"], e.get("index")) for e in events] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
    ]
    assert events[7]["content_block"]["input"] == {} and events[8]["delta"]["partial_json"] == '{"c": 1}'
    end = b.finish("stop", None, Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=4))
    assert end[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end[-2]["usage"] == {
        "input_tokens": 8,
        "output_tokens": 5,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
    }
    msg = b.message("stop", None, Usage(12, 5, 4))
    assert [c["type"] for c in msg["content"]] == ["thinking", "text", "tool_use"] and msg["content"][0][
        "thinking"
    ] == "hm ok"
    assert b.message("length", None, Usage(1))["stop_reason"] == "max_tokens"
    assert MessageBuilder("m").message("stop", "END", Usage(1))["stop_reason"] == "stop_sequence"
    assert MessageBuilder("m").message("stop", None, Usage(1))["stop_reason"] == "end_turn"
    single = MessageBuilder("m", single_tool_call=True)
    single.apply([ToolCall("a", {}), ToolCall("b", {})])
    assert [c["name"] for c in single.content] == ["a"]


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_error_shapes(status, kind):
    assert error_body(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}


@pytest.mark.parametrize("value", [1.5, 1.0001, -0.5])
def test_temperature_outside_anthropics_range_is_refused_naming_it(value):
    """The Messages API's temperature is in [0, 1]."""
    with pytest.raises(InvalidRequest, match=r"^temperature: must be in \[0, 1\]"):
        schema.validate(request(temperature=value))
    schema.validate(request(temperature=1))


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
    "additionalProperties": False,
}


def test_output_config_format_is_the_json_schema_the_answer_must_match():
    """Structured outputs as the anthropic SDK sends them (output_config.format; the beta's first form, a
    top-level output_format, too): the schema and where it is, for the grammar's 400s."""
    fmt = {"type": "json_schema", "schema": PERSON}
    assert schema.output_format(request(output_config={"format": fmt, "effort": "low"})) == (
        PERSON,
        "output_config.format.schema",
    )
    assert schema.output_format(request(output_format=fmt)) == (PERSON, "output_format.schema")
    assert (
        schema.output_format(request()) is None
        and schema.output_format(request(output_config={"effort": "low"})) is None
    )
    assert schema.constrained(request(output_config={"format": fmt})) and not schema.constrained(request())
    assert schema.template_kwargs(request(output_config={"format": fmt})) == {"enable_thinking": False}
    counted = msgspec.json.decode(
        msgspec.json.encode(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "output_config": {"format": fmt}}
        ),
        type=schema.CountTokensRequest,
    )
    assert schema.output_format(counted) == (PERSON, "output_config.format.schema")


@pytest.mark.parametrize(
    "fields,needle",
    [
        (
            {"output_config": {"format": {"type": "xml", "schema": PERSON}}},
            "output_config.format.type: only json_schema",
        ),
        (
            {"output_config": {"format": {"type": "json_schema"}}},
            "output_config.format.schema: a json_schema format needs",
        ),
        (
            {
                "output_config": {"format": {"type": "json_schema", "schema": PERSON}},
                "tools": [{"name": "w"}],
                "tool_choice": {"type": "any"},
            },
            "output_config.format: cannot be combined with tool_choice",
        ),
    ],
)
def test_an_output_format_this_server_cannot_honour_is_refused_naming_the_field(fields, needle):
    with pytest.raises(InvalidRequest, match=needle):
        schema.output_format(request(**fields))


def test_an_output_format_turns_thinking_off_and_closes_a_reasoning_the_template_opens():
    fmt = {"format": {"type": "json_schema", "schema": PERSON}}
    with pytest.raises(InvalidRequest, match="^thinking: "):
        schema.template_kwargs(request(output_config=fmt, thinking={"type": "enabled", "budget_tokens": 1024}))
    assert schema.template_kwargs(request(output_config=fmt, thinking={"type": "disabled"})) == {
        "enable_thinking": False
    }
    assert forced_prompt_suffix(request(output_config=fmt), "assistant\n<think>\n") == "</think>\n\n"
