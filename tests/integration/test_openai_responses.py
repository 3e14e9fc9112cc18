"""The OpenAI Responses API (POST /v1/responses) through the official `openai` client, against the real
api and scheduler. With the PagedHashModel double as the worker, prompts that mention the weather get a
fixed output (reasoning, a sentence, a Qwen-style tool call), so the reasoning / message /
function_call items and their event stream are checked exactly; other prompts get the double's own
continuation (max_output_tokens). previous_response_id continues a stored conversation: the prompt
it builds is the one the whole conversation sent as input builds. Forced tool choices and
text.format json_schema run on the real worker (the tiny random-weight qwen3_moe on CPU): only the
grammar makes its output a call or a JSON object, which must validate."""

from __future__ import annotations

import json
import signal
import urllib.request

import jsonschema
import openai
import pytest

from tests.integration.harness import REAL_WORKER_ENV, labelled_metric, make_model_dir, start_cluster
from tests.integration.test_anthropic_messages import script_ids

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"],
    },
}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def scripted(tiny_tokenizer_dir, tiny_tokenizer, tmp_path_factory):
    script = {"trigger": "weather", "token_ids": script_ids(tiny_tokenizer)}
    model = make_model_dir(
        tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "scripted-responses", tiny_tokenizer, script=script
    )
    c = start_cluster(model, tmp_path_factory.mktemp("responses"), worker_flags=["--max-model-len", "1024"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(scripted):
    return openai.OpenAI(base_url=scripted.base_url + "/v1", api_key="x", max_retries=0, timeout=30)


def items(response) -> list[tuple]:
    out = []
    for item in response.output:
        if item.type == "reasoning":
            assert item.id.startswith("rs_") and item.summary == []
            out.append(("reasoning", "".join(c.text for c in item.content)))
        elif item.type == "message":
            assert item.id.startswith("msg_") and item.role == "assistant" and len(item.content) == 1
            out.append(("message", item.content[0].text))
        else:
            assert item.type == "function_call" and item.id.startswith("fc_") and item.call_id.startswith("call_")
            out.append(("function_call", item.name, json.loads(item.arguments)))
    return out


EXPECTED = [
    ("reasoning", "The user asks about the weather."),
    ("message", "Let me check."),
    ("function_call", "get_weather", {"city": "Paris", "unit": "celsius"}),
]


def test_reasoning_message_and_function_call_not_streamed(client):
    r = client.responses.create(model="tiny", input=ASK, tools=[WEATHER], max_output_tokens=200)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny" and r.status == "completed"
    assert items(r) == EXPECTED and r.output_text == "Let me check." and r.incomplete_details is None
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto" and r.parallel_tool_calls is True


def test_streamed_events_in_the_sdk_order_and_the_final_response(client):
    events = list(client.responses.create(model="tiny", input=ASK, tools=[WEATHER], max_output_tokens=200, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * _count(events, "response.reasoning_text.delta"),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * _count(events, "response.output_text.delta"),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (reasoning, text) == ("The user asks about the weather.", "Let me check.")
    assert items(events[-1].response) == EXPECTED and events[-1].response.usage.output_tokens > 0
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(i.type, i.status) for i in added] == [
        ("reasoning", "in_progress"),
        ("message", "in_progress"),
        ("function_call", "in_progress"),
    ]
    # the SDK's accumulating stream helper checks the sequence (identities, indexes) and builds the response
    with client.responses.stream(model="tiny", input=ASK, tools=[WEATHER], max_output_tokens=200) as stream:
        seen = [e.type for e in stream]
        final = stream.get_final_response()
    assert items(final) == EXPECTED and seen[-1] == "response.completed"
    assert final.output[2].parsed_arguments is None  # strict false: the SDK leaves the arguments unparsed


def _count(events, kind: str) -> int:
    n = sum(e.type == kind for e in events)
    assert n >= 1
    return n


def test_raw_stream_names_every_event(scripted):
    req = urllib.request.Request(
        scripted.base_url + "/v1/responses",
        method="POST",
        headers={"content-type": "application/json"},
        data=json.dumps(
            {"model": "tiny", "input": "Mixture of experts", "stream": True, "max_output_tokens": 4}
        ).encode(),
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        frames = r.read().decode().strip().split("\n\n")
    for frame in frames:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and json.loads(data.removeprefix("data: "))["type"] == event[7:]
    last = json.loads(frames[-1].split("\n")[1][6:])
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert last["response"]["usage"]["output_tokens"] == 4


def test_max_output_tokens_makes_an_incomplete_response(client):
    r = client.responses.create(model="tiny", input="Mixture of experts", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[-1].status == "incomplete"


def test_previous_response_id_continues_the_conversation(client):
    """The follow-up's prompt is the whole conversation: as many input tokens as the same turns sent
    as input items (what the first response returned, then the tool's output)."""
    first = client.responses.create(
        model="tiny", input=ASK, tools=[WEATHER], max_output_tokens=200, instructions="Be brief."
    )
    call = first.output[-1]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}
    follow = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[answer],
        tools=[WEATHER],
        instructions="Be brief.",
        max_output_tokens=2,
    )
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    whole = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in first.output], answer]
    explicit = client.responses.create(
        model="tiny", input=whole, tools=[WEATHER], instructions="Be brief.", max_output_tokens=2, store=False
    )
    assert follow.usage.input_tokens == explicit.usage.input_tokens
    # a plain text turn after a text answer; instructions are not carried over (each request sends its own)
    second = client.responses.create(
        model="tiny", previous_response_id=follow.id, input="And tomorrow?", max_output_tokens=2
    )
    again = client.responses.create(
        model="tiny",
        input=[
            *whole,
            *[o.model_dump(exclude_none=True) for o in follow.output],
            {"role": "user", "content": "And tomorrow?"},
        ],
        max_output_tokens=2,
        store=False,
    )
    assert second.usage.input_tokens == again.usage.input_tokens


def test_stored_responses_are_retrieved_and_deleted_and_an_unknown_id_is_a_404(client):
    kept = client.responses.create(model="tiny", input="Mixture of experts", max_output_tokens=2)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unkept = client.responses.create(model="tiny", input="Mixture of experts", max_output_tokens=2, store=False)
    for missing in (unkept.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError) as exc:
            client.responses.create(model="tiny", input="Hi", previous_response_id=missing)
        assert exc.value.body["param"] == "previous_response_id" and missing in exc.value.body["message"]
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


BAD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}},
}  # llguidance: no lookbehind
ENDLESS = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}  # no finite value matches


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),  # the scheduler's refusal: past the model length (1024)
        ({"input": "hello " * 1100}, "input"),  # the prompt alone is past it
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": ENDLESS}}}, "text.format.schema"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}}}, "text.format.schema"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": BAD_SCHEMA}], "tool_choice": "required"},
            "tools[f].parameters",
        ),
        ({"text": {"format": {"type": "json_object"}}, "tools": [WEATHER], "tool_choice": "required"}, "text.format"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
            "input[0].arguments",
        ),
    ],
)
def test_unsupported_fields_are_400s_naming_them(client, fields, param):
    body = {"model": "tiny", "input": "Hi", **fields}
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(**body)
    assert exc.value.body["param"] == param, exc.value.body


def test_requests_are_counted_under_the_responses_route(scripted, client):
    """ferry_requests_total{route="responses"}: those that ran (Generation's count) and those refused before."""

    def count(outcome: str) -> float:
        return labelled_metric(scripted.base_url, "ferry_requests_total", route="responses", outcome=outcome)

    refused, finished = count("refused"), count("length")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="Hi", background=True)
    client.responses.create(model="tiny", input="Mixture of experts", max_output_tokens=2)
    assert (count("refused"), count("length")) == (refused + 1, finished + 1)


# ---- the real worker: grammars ---------------------------------------------------------------------

# bounded arguments: the random-weight model writes whatever the grammar allows, and stops only where it must
CITY = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "strict": False,
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "days"],
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "The time in a zone",
    "strict": True,
    "parameters": {
        "type": "object",
        "required": ["zone"],
        "additionalProperties": False,
        "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
    },
}
SCHEMAS = {t["name"]: t["parameters"] for t in (CITY, TIME)}


@pytest.fixture(scope="module")
def real_client(tiny_models, tmp_path_factory):
    c = start_cluster(
        tiny_models["qwen3_moe"],
        tmp_path_factory.mktemp("responses-real"),
        worker_flags=["--device", "cpu", "--max-model-len", "1024", "--max-prefill-tokens", "64"],
        boot="ferry.services.worker.boot:boot_worker",
        worker_env=REAL_WORKER_ENV,
    )
    yield openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    c.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_tool_choice_gives_function_calls_that_validate(real_client, choice):
    for seed in range(3):
        r = real_client.responses.create(
            model="tiny",
            input="Hi",
            tools=[CITY, TIME],
            tool_choice=choice,
            parallel_tool_calls=False,
            extra_body={"seed": seed},
        )
        assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r.output
        call = r.output[0]
        assert call.name == (choice["name"] if isinstance(choice, dict) else call.name)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_forced_tool_choice_streamed_through_the_sdk_helper(real_client):
    with real_client.responses.stream(
        model="tiny", input="Hi", tools=[TIME], tool_choice="required", extra_body={"seed": 1}
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls and all(o.type == "function_call" for o in final.output)
    for call in calls:  # strict: the SDK parses the arguments, which match the schema
        jsonschema.validate(call.parsed_arguments, TIME["parameters"])
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert [json.loads(e.delta) for e in deltas] == [json.loads(c.arguments) for c in calls]


def test_text_format_json_schema_output_validates(real_client):
    fmt = {
        "type": "json_schema",
        "name": "city",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    r = real_client.responses.create(model="tiny", input="A city?", text={"format": fmt}, extra_body={"seed": 0})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), fmt["schema"])
    assert r.text.format.type == "json_schema"


# ---- an error after the stream began ----------------------------------------------------------------


def test_a_worker_lost_mid_stream_ends_it_with_response_failed(slow_model_dir, tmp_path_factory):
    c = start_cluster(slow_model_dir, tmp_path_factory.mktemp("responses-lost"))
    try:
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        events, deltas = [], 0
        with client.responses.stream(model="tiny", input="Mixture of experts", max_output_tokens=400) as stream:
            for e in stream:
                events.append(e)
                deltas += e.type == "response.output_text.delta"
                if deltas == 3 and e.type == "response.output_text.delta":
                    c.procs["worker"].send_signal(signal.SIGKILL)
        assert events[-1].type == "response.failed", [e.type for e in events[-3:]]
        failed = events[-1].response
        assert failed.status == "failed" and failed.error.code == "server_error", failed.error
        assert "worker" in failed.error.message and deltas >= 3, (failed.error, deltas)
    finally:
        c.stop()
