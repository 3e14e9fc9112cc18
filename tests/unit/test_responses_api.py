"""The OpenAI Responses route without a server: the request body as the chat template and the sampler
see it, the response object and events as the official SDK's models validate them (pydantic, every
required field), and the bounded store of previous_response_id."""

from __future__ import annotations

import msgspec
import pytest
from openai.types.responses import Response, ResponseCreateParams, ResponseStreamEvent
from pydantic import TypeAdapter

from ferry.services.api import responses_schema as schema
from ferry.services.api.generation import Usage
from ferry.services.api.output_parsers import Reasoning, Text, ToolCall
from ferry.services.api.responses_output import ResponseBuilder
from ferry.services.api.responses_store import ResponseStore
from ferry.shared.errors import InvalidRequest, ServiceUnavailable


def request(**fields) -> schema.ResponsesRequest:
    body = {"model": "m", "input": "hi", **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=schema.ResponsesRequest)


def refused(param: str, **fields) -> str:
    with pytest.raises(InvalidRequest) as exc:
        req = request(**fields)
        schema.validate(req)
        schema.template_messages(req.instructions, schema.input_items(req))
        schema.template_tools(req)
        schema.sampling_params(req, (0,), None)
    assert exc.value.param == param, (exc.value.param, str(exc.value))
    return str(exc.value)


# ---- the request ------------------------------------------------------------------------------------


def test_every_field_of_the_sdk_request_is_taken_or_refused():
    """A field the SDK can send that the struct does not know would be ignored without a word."""
    sdk = set().union(*(t.__annotations__ for t in ResponseCreateParams.__args__))
    assert sdk - set(schema.ResponsesRequest.__struct_fields__) == set()


def test_input_items_become_template_messages():
    req = request(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Paris?"}],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "use it"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                "status": "completed",
            },
            {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": '{"c": "P"}'},
            {"type": "function_call", "call_id": "call_2", "name": "w", "arguments": ""},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
            {"type": "reasoning", "summary": [], "encrypted_content": schema.encrypt_reasoning("think again")},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "Thanks"},
        ],
    )
    assert schema.template_messages(req.instructions, schema.input_items(req)) == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "use it",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": {"c": "P"}}},
                {"id": "call_2", "type": "function", "function": {"name": "w", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "think again"},
        {"role": "user", "content": "Thanks"},
    ]


def test_a_system_message_after_the_first_turn_stays_where_it_is():
    items = [
        schema.InputItem(role="system", content="A"),
        schema.InputItem(role="user", content="Hi"),
        schema.InputItem(role="developer", content="B"),
    ]
    assert schema.template_messages(None, items) == [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "B"},
    ]


def test_stored_turns_come_first_and_errors_count_from_the_request_input():
    earlier = schema.output_items(
        [
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
            }
        ]
    )
    items = [schema.InputItem(role="user", content="Hi"), *earlier, schema.InputItem(role="user", content="More")]
    assert schema.template_messages(None, items, first=2) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "More"},
    ]
    with pytest.raises(InvalidRequest) as exc:
        schema.template_messages(None, [*items, schema.InputItem(type="web_search_call")], first=2)
    assert exc.value.param == "input[1].type"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"truncation": "auto"}, "truncation"),
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include[1]"),
        ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "%%%"}]}, "input[0].encrypted_content"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools[1].name"),
        (
            {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
            "tool_choice.name",
        ),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 2.5}, "temperature"),  # OpenAI's range: [0, 2]
    ],
)
def test_unsupported_or_bad_fields_are_400s_naming_them(fields, param):
    refused(param, **fields)


def test_accepted_fields_and_their_effect():
    req = request(
        store=False,
        stream_options={"include_obfuscation": False},
        include=["reasoning.encrypted_content"],
        service_tier="auto",
        truncation="disabled",
        prompt_cache_key="k",
        prompt_cache_retention="in_memory",
        user="u",
        safety_identifier="s",
        max_tool_calls=3,
        metadata={"a": "b"},
        reasoning={"effort": "minimal", "summary": "auto"},
        temperature=0,
        top_k=5,
        seed=7,
        unknown_extension_field=1,
    )
    schema.validate(req)
    params = schema.sampling_params(req, (2, 2, 3), None)
    assert (params.temperature, params.top_k, params.seed, params.stop_token_ids) == (0, 5, 7, (2, 3))
    assert schema.template_kwargs(req, constrained=False) == {"reasoning_effort": "minimal", "enable_thinking": False}
    assert schema.template_kwargs(request(reasoning={"effort": "high"}), constrained=False) == {
        "reasoning_effort": "high",  # gpt-oss's templates read it
        "enable_thinking": True,
    }
    assert schema.template_kwargs(request(), constrained=False) == {}
    assert schema.template_kwargs(req, constrained=True) == {"enable_thinking": False}


def test_tools_choices_and_text_formats():
    tools = [
        {
            "type": "function",
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            "strict": True,
        },
        {"type": "function", "name": "g", "description": "G"},
    ]
    req = request(tools=tools)
    assert schema.template_tools(req) == [
        {"type": "function", "function": {"name": "f", "description": "", "parameters": tools[0]["parameters"]}},
        {
            "type": "function",
            "function": {"name": "g", "description": "G", "parameters": {"type": "object", "properties": {}}},
        },
    ]
    assert schema.forced_tools(req) is None and schema.tool_schemas(req) == {"f": tools[0]["parameters"], "g": {}}
    named = request(tools=tools, tool_choice={"type": "function", "name": "g"})
    assert schema.template_tools(named) is not None and schema.forced_tools(named) == [("g", {"type": "object"})]
    assert len(schema.forced_tools(request(tools=tools, tool_choice="required"))) == 2
    none = request(tools=tools, tool_choice="none")
    assert schema.template_tools(none) is None and schema.tool_schemas(none) is None
    assert not schema.parallel_calls(request(parallel_tool_calls=False))
    assert schema.text_format_schema(request()) is None
    assert schema.text_format_schema(request(text={"format": {"type": "json_object"}})) == {"type": "object"}
    fmt = {"type": "json_schema", "name": "n", "schema": {"type": "object"}}
    assert schema.text_format_schema(request(text={"format": fmt})) == {"type": "object"}


# ---- the response: the SDK's own models validate it ------------------------------------------------

EVENTS = TypeAdapter(ResponseStreamEvent)


def sdk_events(events: list[dict]) -> list:
    return [EVENTS.validate_python(e) for e in events]


def built(events_in: list, reason: str = "stop", **kwargs) -> tuple[ResponseBuilder, list[dict]]:
    b = ResponseBuilder({"model": "m", "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}, **kwargs)
    out = b.start()
    for e in events_in:
        out += b.apply([e])
    out += b.finish(reason, Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=3))
    return b, out


def test_events_and_response_validate_against_the_sdk_models():
    call = ToolCall("w", {"c": "P"})
    b, events = built(
        [Reasoning("think "), Reasoning("hard"), Text("\n\n"), Text("Hi"), Text(" there"), call, call],
        max_calls=1,
        encrypted_reasoning=True,
    )
    parsed = sdk_events(events)
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type for e in parsed] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = Response.model_validate(b.final)
    assert final == parsed[-1].response and final.status == "completed" and final.output_text == "Hi there"
    reasoning, message, fc = final.output
    assert (
        reasoning.content[0].text == "think hard"
        and schema.reasoning_text(
            schema.InputItem(type="reasoning", encrypted_content=reasoning.encrypted_content), "x"
        )
        == "think hard"
    )
    assert (fc.call_id, fc.name, fc.arguments, fc.status) == (call.id, "w", '{"c": "P"}', "completed")
    assert final.usage.input_tokens_details.cached_tokens == 3 and final.usage.total_tokens == 12
    assert parsed[2].item.status == "in_progress" and parsed[0].response.output == []


def test_a_cut_output_is_incomplete_and_an_error_fails_the_response():
    b, events = built([Text("Hi")], reason="length")
    parsed = sdk_events(events)
    assert (
        parsed[-1].type == "response.incomplete"
        and parsed[-1].response.incomplete_details.reason == "max_output_tokens"
    )
    assert parsed[-1].response.output[0].status == "incomplete"
    b = ResponseBuilder({"model": "m", "parallel_tool_calls": True, "tool_choice": "auto", "tools": []})
    events = b.start() + b.apply([Text("Hi")]) + b.failed(ServiceUnavailable("the worker was lost"))
    failed = sdk_events(events)[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert (failed.response.error.code, failed.response.error.message) == ("server_error", "the worker was lost")


def test_reasoning_tokens_count_deltas_that_were_all_reasoning():
    b = ResponseBuilder({})
    b.count_reasoning_tokens([Reasoning("a")], 2)
    b.count_reasoning_tokens([Reasoning("a"), Text("b")], 3)
    b.count_reasoning_tokens([], 1)
    assert b.reasoning_tokens == 2


# ---- the store --------------------------------------------------------------------------------------


def _response(rid: str, text: str = "x") -> dict:
    return {
        "id": rid,
        "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}],
    }


def test_the_store_drops_the_least_recently_used_past_its_count():
    store = ResponseStore(max_count=2, max_bytes=1 << 20)
    for rid in ("a", "b"):
        store.put(_response(rid), [schema.InputItem(role="user", content=rid)])
    assert store.get("a").conversation == [schema.InputItem(role="user", content="a")]  # a is now the most recent
    store.put(_response("c"), [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c").response == _response("c")
    assert len(store) == 2


def test_the_store_holds_at_most_its_bytes_and_never_one_response_larger():
    one = len(msgspec.json.encode(_response("a", "x" * 100))) + len(msgspec.json.encode([]))
    store = ResponseStore(max_count=100, max_bytes=2 * one + 10)
    for rid in "abc":
        assert store.put(_response(rid, "x" * 100), [])
        assert store.bytes <= store.max_bytes
    assert store.get("a") is None and len(store) == 2 and store.bytes == 2 * one
    assert not store.put(_response("big", "x" * 1000), [])
    assert store.get("big") is None and len(store) == 2
    assert store.pop("b") and not store.pop("b") and store.bytes == one


# ---- the route -------------------------------------------------------------------------------------


def test_a_short_body_continuing_a_long_stored_conversation_takes_the_long_tokenizer_lane():
    """The lane goes by the prompt's size (routes.LONG_BODY_BYTES), not the body's: a few bytes naming
    previous_response_id may render a conversation of megabytes."""
    import asyncio
    from types import SimpleNamespace

    from ferry.services.api.body_decoding import BodyDecoder
    from ferry.services.api.grammar_lanes import GrammarLanes
    from ferry.services.api.metrics import ApiMetrics
    from ferry.services.api.responses_api import ResponsesRoutes
    from ferry.services.api.routes import LONG_BODY_BYTES

    sizes = []

    class Stop(Exception):
        pass

    async def tokenize(fn, arg, size):
        sizes.append((fn.__name__, size))
        raise Stop

    store = ResponseStore()
    store.put(_response("resp_long"), [schema.InputItem(role="user", content="x" * (2 * LONG_BODY_BYTES))])
    routes = ResponsesRoutes(
        SimpleNamespace(served_model_name="m"),
        None,
        SimpleNamespace(eos_token_ids=(0,)),
        None,
        tokenize,
        GrammarLanes(ApiMetrics()),
        BodyDecoder(),
        store,
    )
    body = msgspec.json.encode({"model": "m", "input": "more", "previous_response_id": "resp_long"})

    async def read():
        return body

    with pytest.raises(Stop):
        asyncio.run(routes.create(SimpleNamespace(read=read)))
    assert sizes[0][0] == "_prompt" and sizes[0][1] > 2 * LONG_BODY_BYTES > len(body)
