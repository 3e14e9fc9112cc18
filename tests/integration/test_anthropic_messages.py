"""The Anthropic Messages API through the official `anthropic` client, against the real api and
scheduler with the PagedHashModel double as the worker. Prompts that mention the weather get a fixed
output (the double's script: reasoning, a sentence, a Qwen-style tool call), so the route's
thinking / text / tool_use blocks are checked exactly; other prompts get the double's known
continuation (max_tokens, stop_sequences). Forced tool choices (any, tool) run on the real worker
(the tiny random-weight qwen3_moe on CPU): only the grammar makes its output a call, and the tool_use
blocks' input must validate against the input_schema. The real model behind `ferry serve`:
test_serve_user_facing.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import anthropic
import jsonschema
import pydantic
import pytest

from tests.doubles.paged_model import reference_continuation
from tests.helpers import order_model
from tests.integration.harness import (
    REAL_WORKER_ENV,
    ascii_word_tokens,
    http_get,
    labelled_metric,
    make_model_dir,
    start_cluster,
)

KEY = "sesame"
SCRIPT = (
    "<think>\nThe user asks about the weather.\n</think>\n\nLet me check.\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>'
)
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted(tiny_tokenizer_dir, tiny_tokenizer, tmp_path_factory):
    script = {"trigger": "weather", "token_ids": script_ids(tiny_tokenizer)}
    model = make_model_dir(
        tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "scripted", tiny_tokenizer, script=script
    )
    c = start_cluster(
        model,
        tmp_path_factory.mktemp("anthropic"),
        worker_flags=["--max-model-len", "1024"],
        api_flags=["--api-key", KEY],
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(scripted):
    return anthropic.Anthropic(base_url=scripted.base_url, api_key=KEY, max_retries=0, timeout=30)


def expected_blocks():
    return [
        ("thinking", "The user asks about the weather."),
        ("text", "Let me check."),
        ("tool_use", "get_weather", {"city": "Paris", "unit": "celsius"}),
    ]


def blocks(content) -> list[tuple]:
    out = []
    for b in content:
        if b.type == "thinking":
            out.append(("thinking", b.thinking))
        elif b.type == "text":
            out.append(("text", b.text))
        else:
            out.append(("tool_use", b.name, b.input))
            assert b.id.startswith("toolu_")
    return out


def script_ids(tok) -> list[int]:
    return tok.encode(SCRIPT, add_special_tokens=False)


@pytest.mark.parametrize("choice", [None, {"type": "auto"}])
def test_tool_use_not_streamed(client, tiny_tokenizer, choice):
    """tool_choice auto (or none given): the model's own <tool_call> markup becomes a tool_use block."""
    extra = {"tool_choice": choice} if choice else {}
    msg = client.messages.create(model="tiny", max_tokens=200, tools=[WEATHER], messages=ASK, **extra)
    assert blocks(msg.content) == expected_blocks()
    jsonschema.validate(msg.content[-1].input, WEATHER["input_schema"])
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None and msg.role == "assistant"
    assert msg.id.startswith("msg_") and msg.model == "tiny"
    counted = client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=ASK).input_tokens
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == counted
    assert msg.usage.output_tokens == len(script_ids(tiny_tokenizer))  # the end-of-turn token included


def test_tool_use_streamed_event_sequence_and_final_message(client):
    with client.messages.stream(model="tiny", max_tokens=200, tools=[WEATHER], messages=ASK) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert blocks(final.content) == expected_blocks() and final.stop_reason == "tool_use"
    kinds = [
        e.type
        for e in events
        if e.type in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop")
    ]
    assert kinds == [
        "message_start",
        *["content_block_start", "content_block_stop"] * 3,
        "message_delta",
        "message_stop",
    ]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta", "input_json_delta"}
    assert final.usage.output_tokens > 0


def test_raw_stream_names_every_event_and_pings_after_message_start(scripted):
    req = urllib.request.Request(
        scripted.base_url + "/v1/messages",
        method="POST",
        headers={"x-api-key": KEY, "content-type": "application/json", "anthropic-version": "2023-06-01"},
        data=json.dumps(
            {
                "model": "tiny",
                "max_tokens": 5,
                "stream": True,
                "messages": [{"role": "user", "content": "Mixture of experts"}],
            }
        ).encode(),
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream") and r.headers["request-id"].startswith("msg_")
        frames = r.read().decode().strip().split("\n\n")
    names = []
    for frame in frames:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
        names.append(event[7:])
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    delta = json.loads(frames[-2].split("\n")[1][6:])
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 5


def test_multi_turn_with_tool_result_renders_through_the_chat_template(client, tiny_tokenizer):
    first = client.messages.create(model="tiny", max_tokens=200, tools=[WEATHER], messages=ASK)
    call = next(b for b in first.content if b.type == "tool_use")
    turns = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                {"type": "text", "text": "Thanks, and tomorrow?"},
            ],
        },
    ]
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", tools=[WEATHER], messages=turns)
    tool = {
        "type": "function",
        "function": {
            "name": WEATHER["name"],
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        },
    }
    rendered = tiny_tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            ASK[0],
            {
                "role": "assistant",
                "content": "Let me check.",
                "reasoning_content": "The user asks about the weather.",
                "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.input}}
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"},
            {"role": "user", "content": "Thanks, and tomorrow?"},
        ],
        tools=[tool],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in rendered and '"name": "get_weather"' in rendered
    assert counted.input_tokens == len(tiny_tokenizer.encode(rendered, add_special_tokens=False))
    again = client.messages.create(model="tiny", max_tokens=200, system="Be brief.", tools=[WEATHER], messages=turns)
    assert again.stop_reason == "tool_use"


def expected_text(tok, messages, n):
    ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    return tok.decode(reference_continuation(ids, n, ascii_word_tokens(tok)), skip_special_tokens=True)


def test_max_tokens_stop_sequences_and_sampling_fields(client, tiny_tokenizer):
    """The double's output does not depend on sampling; the fields must be accepted and validated."""
    messages = [{"role": "user", "content": "Carry the experts across."}]
    text = expected_text(tiny_tokenizer, messages, 30)
    # sampling fields through extra_body: newer clients dropped them from create()'s signature, the API still takes them
    msg = client.messages.create(
        model="tiny", max_tokens=30, messages=messages, extra_body={"temperature": 0, "top_p": 0.9, "top_k": 5}
    )
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 30
    assert [(b.type, b.text) for b in msg.content] == [("text", text)]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.messages.create(model="tiny", max_tokens=30, messages=messages, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    streamed = client.messages.create(
        model="tiny", max_tokens=30, messages=messages, stop_sequences=[stop], stream=True
    )
    events = list(streamed)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text[: text.index(stop)]
    assert [e.delta.stop_sequence for e in events if e.type == "message_delta"] == [stop]


def test_system_prompt_and_assistant_prefill(client, tiny_tokenizer):
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "The ferry"}]
    msg = client.messages.create(
        model="tiny", max_tokens=8, system=[{"type": "text", "text": "You are a ferry."}], messages=messages
    )
    prompt = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a ferry."}, *messages], continue_final_message=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\nThe ferry")
    ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    assert msg.content[0].text == tiny_tokenizer.decode(
        reference_continuation(ids, 8, ascii_word_tokens(tiny_tokenizer))
    )
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == len(ids)


def test_errors_have_anthropic_shapes_and_are_counted(scripted, client):
    before = labelled_metric(scripted.base_url, "ferry_refused_requests_total", route="/v1/messages", status="401")
    bad_key = anthropic.Anthropic(base_url=scripted.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad_key.messages.create(model="tiny", max_tokens=5, messages=ASK)
    assert err.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": err.value.body["error"]["message"]},
    }
    assert "x-api-key" in err.value.body["error"]["message"]
    assert (
        labelled_metric(scripted.base_url, "ferry_refused_requests_total", route="/v1/messages", status="401")
        == before + 1
    )
    bearer = anthropic.Anthropic(base_url=scripted.base_url, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.count_tokens(model="tiny", messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-opus-4", max_tokens=5, messages=ASK)
    assert err.value.body["error"]["type"] == "not_found_error" and "tiny" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="tiny",
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                    ],
                }
            ],
        )
    assert (
        err.value.body["error"]["type"] == "invalid_request_error" and "text-only" in err.value.body["error"]["message"]
    )
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=0, messages=ASK)
    assert "max_tokens" in err.value.body["error"]["message"]
    status, body = _post(scripted.base_url + "/v1/messages", {"model": "tiny", "messages": ASK})  # no max_tokens
    assert status == 400 and json.loads(body)["type"] == "error" and "max_tokens" in body
    status, body = http_get(scripted.base_url + "/v1/models")  # the OpenAI routes keep OpenAI's shape
    assert status == 401 and "error" in json.loads(body) and "type" not in json.loads(body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_off_by_max_tokens_leaks_no_markup(client, tiny_tokenizer, stream):
    """max_tokens ends the output inside the model's own call: stop_reason max_tokens, the blocks before
    it, and neither a tool_use block nor any of the call's raw markup in the text."""
    cut = len(tiny_tokenizer.encode(SCRIPT[: SCRIPT.index('"city"')], add_special_tokens=False))
    kwargs = dict(model="tiny", max_tokens=cut, tools=[WEATHER], messages=ASK)
    if stream:
        with client.messages.stream(**kwargs) as s:
            texts = [e.delta.text for e in s if e.type == "content_block_delta" and e.delta.type == "text_delta"]
            msg = s.get_final_message()
        assert "".join(texts) == "Let me check."
    else:
        msg = client.messages.create(**kwargs)
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == cut
    assert blocks(msg.content) == expected_blocks()[:2]


def test_forced_tool_choice_needs_tools_and_a_known_name(client, tiny_tokenizer):
    forced = client.messages.count_tokens(
        model="tiny",
        tools=[WEATHER],
        messages=[{"role": "user", "content": "hi"}],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    tool = {
        "type": "function",
        "function": {
            "name": WEATHER["name"],
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        },
    }
    rendered = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        tools=[tool],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    # the prompt is the template's, thinking off: the grammar writes the whole call, the prompt none of it
    assert forced.input_tokens == len(tiny_tokenizer.encode(rendered, add_special_tokens=False))
    with pytest.raises(anthropic.BadRequestError, match="not one of the tools"):
        client.messages.create(
            model="tiny",
            max_tokens=5,
            tools=[WEATHER],
            messages=ASK,
            tool_choice={"type": "tool", "name": "no_such_tool"},
        )
    with pytest.raises(anthropic.BadRequestError, match="need tools"):
        client.messages.create(model="tiny", max_tokens=5, messages=ASK, tool_choice={"type": "any"})
    bad = {
        "name": "f",
        "input_schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=a)b"}}},
    }
    with pytest.raises(anthropic.BadRequestError, match=r"tools\[f\]\.input_schema"):
        client.messages.create(model="tiny", max_tokens=5, tools=[bad], messages=ASK, tool_choice={"type": "any"})


# ---- forced tool choices on the real worker (the tiny random-weight model) ------------------------

CITY = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
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
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "additionalProperties": False,
        "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
    },
}
SCHEMAS = {t["name"]: t["input_schema"] for t in (CITY, TIME)}


@pytest.fixture(scope="module")
def real_client(tiny_models, tmp_path_factory):
    c = start_cluster(
        tiny_models["qwen3_moe"],
        tmp_path_factory.mktemp("anthropic-real"),
        worker_flags=["--device", "cpu", "--max-model-len", "1024", "--max-prefill-tokens", "64"],
        boot="ferry.services.worker.boot:boot_worker",
        worker_env=REAL_WORKER_ENV,
    )
    yield anthropic.Anthropic(base_url=c.base_url, api_key="x", max_retries=0, timeout=120)
    c.stop()


def _tool_uses(msg, choice: dict) -> list:
    """The message's tool_use blocks, checked: all of it, each valid, as many as the choice allows."""
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None, msg
    assert msg.content and all(b.type == "tool_use" for b in msg.content), msg.content
    assert 1 <= len(msg.content) <= (1 if choice.get("disable_parallel_tool_use") else 4)  # structured.MAX_CALLS
    for b in msg.content:
        assert b.id.startswith("toolu_") and b.name == choice.get("name", b.name)
        jsonschema.validate(b.input, SCHEMAS[b.name])
    return msg.content


CHOICES = [
    {"type": "any"},
    {"type": "tool", "name": "get_time"},
    {"type": "any", "disable_parallel_tool_use": True},
    {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
]


def _forced(client, choice: dict) -> dict:
    """The request: both tools, and max_tokens up to the model length (1024), as an agent would send it."""
    body = dict(model="tiny", tools=[CITY, TIME], tool_choice=choice, messages=[{"role": "user", "content": "Hi"}])
    return {**body, "max_tokens": 1024 - client.messages.count_tokens(**body).input_tokens}


@pytest.mark.parametrize("choice", CHOICES)
def test_forced_tool_choice_gives_tool_use_blocks_that_validate(real_client, choice):
    """A model that writes arbitrary tokens calls the tool anyway: the grammar holds its output to
    calls whose arguments match the input_schema, and ends it after them; several tries, each a
    different sample (the Messages API has no seed), sent together (one batch rather than five in turn)."""
    with ThreadPoolExecutor(5) as pool:
        messages = list(pool.map(lambda _: real_client.messages.create(**_forced(real_client, choice)), range(5)))
    for message in messages:
        _tool_uses(message, choice)


@pytest.mark.parametrize("choice", CHOICES[:3])
def test_forced_tool_choice_streamed_as_tool_use_events(real_client, choice):
    def streamed(_):
        with real_client.messages.stream(**_forced(real_client, choice)) as stream:
            return list(stream), stream.get_final_message()

    with ThreadPoolExecutor(3) as pool:  # three samples together
        samples = list(pool.map(streamed, range(3)))
    for events, final in samples:
        uses = _tool_uses(final, choice)
        starts = [e for e in events if e.type == "content_block_start"]
        assert [(e.content_block.type, e.content_block.name, e.content_block.input) for e in starts] == [
            ("tool_use", b.name, {}) for b in uses
        ]
        for i, b in enumerate(uses):  # each block: start, its input as input_json_delta, stop
            partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta" and e.index == i)
            assert json.loads(partial) == b.input
            assert {e.delta.type for e in events if e.type == "content_block_delta" and e.index == i} == {
                "input_json_delta"
            }
        kinds = [
            e.type
            for e in events
            if e.type in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop")
        ]  # not the client's own
        assert kinds == [
            "message_start",
            *["content_block_start", "content_block_stop"] * len(uses),
            "message_delta",
            "message_stop",
        ]
        assert [e.delta.stop_reason for e in events if e.type == "message_delta"] == ["tool_use"]


def _post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(
        url,
        method="POST",
        data=json.dumps(body).encode(),
        headers={"x-api-key": KEY, "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ---- issue 56 / 57: output formats, $defs in tool schemas, ranges (the real worker) ------------------------


ORDER = order_model()
FORMAT = {"type": "json_schema", "schema": ORDER.model_json_schema()}
ORDER_TOOL = {"name": "place_order", "description": "Place an order", "input_schema": ORDER.model_json_schema()}


def test_output_config_format_holds_the_answer_to_the_schema(real_client):
    """output_config.format as the SDK sends it: the answer is one text block of JSON that validates (a
    Pydantic schema, nested model under $defs), streamed or not; several tries, each a different sample."""
    ask = dict(model="tiny", max_tokens=200, messages=[{"role": "user", "content": "An order, please."}])
    for _ in range(3):
        msg = real_client.messages.create(**ask, output_config={"format": FORMAT})
        assert msg.stop_reason == "end_turn" and [b.type for b in msg.content] == ["text"], msg
        jsonschema.validate(json.loads(msg.content[0].text), FORMAT["schema"])
    with real_client.messages.stream(**ask, output_config={"format": FORMAT}) as stream:
        text = "".join(stream.text_stream)
        assert stream.get_final_message().stop_reason == "end_turn"
    jsonschema.validate(json.loads(text), FORMAT["schema"])
    # the SDK's own Pydantic path (it moves bounds such as maxItems into descriptions: a model without them)
    verdict = pydantic.create_model("Verdict", answer=(Literal["yes", "no"], ...), sure=(bool, ...))
    assert isinstance(real_client.messages.parse(**ask, output_format=verdict).parsed_output, verdict)
    counted = real_client.messages.count_tokens(
        model="tiny", messages=ask["messages"], output_config={"format": FORMAT}
    )
    assert (
        counted.input_tokens == real_client.messages.count_tokens(model="tiny", messages=ask["messages"]).input_tokens
    )


@pytest.mark.parametrize(
    "fmt,field",
    [
        ({"type": "xml", "schema": {}}, "output_config.format.type"),
        (
            {
                "type": "json_schema",
                "schema": {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}},
            },
            "output_config.format.schema",
        ),
    ],
)
def test_an_output_format_this_server_cannot_honour_is_a_400_naming_the_field(client, fmt, field):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=20, messages=ASK, output_config={"format": fmt})
    assert err.value.body["error"]["type"] == "invalid_request_error" and field in err.value.body["error"]["message"]
    if field.endswith(".type"):  # count_tokens checks the format as /v1/messages does (it compiles no grammar)
        with pytest.raises(anthropic.BadRequestError, match=field):
            client.messages.count_tokens(model="tiny", messages=ASK, output_config={"format": fmt})


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "any", "disable_parallel_tool_use": True},
        {"type": "tool", "name": "place_order", "disable_parallel_tool_use": True},
    ],
)
def test_forced_tool_choice_with_a_pydantic_schema_of_nested_models(real_client, choice):
    """A tool whose input_schema Pydantic wrote ($defs, refs into it): the forced call's grammar resolves them."""
    body = dict(
        model="tiny", tools=[ORDER_TOOL, TIME], tool_choice=choice, messages=[{"role": "user", "content": "Bolts"}]
    )
    body["max_tokens"] = 1024 - real_client.messages.count_tokens(**body).input_tokens
    for _ in range(3):
        msg = real_client.messages.create(**body)
        assert msg.stop_reason == "tool_use" and msg.content, msg
        for b in msg.content:
            assert b.type == "tool_use" and b.name == choice.get("name", b.name)
            jsonschema.validate(b.input, ORDER_TOOL["input_schema"] if b.name == "place_order" else SCHEMAS[b.name])


def test_temperature_above_one_and_an_over_long_answer_are_400s_naming_the_field(client):
    """The Messages API's temperature is in [0, 1]; prompt + max_tokens past the model length (1024) names
    max_tokens."""
    for temperature in (1.5, -0.1):
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model="tiny", max_tokens=5, messages=ASK, extra_body={"temperature": temperature})
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert err.value.body["error"]["message"].startswith("temperature: must be in [0, 1]")
    assert (
        client.messages.create(model="tiny", max_tokens=2, messages=ASK, extra_body={"temperature": 1.0}).stop_reason
        == "max_tokens"
    )
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=5000, messages=ASK)
    assert (
        err.value.body["error"]["type"] == "invalid_request_error"
        and "lower max_tokens" in err.value.body["error"]["message"]
    )
