"""Issue 11's must-shows against the real worker (the tiny random-weight qwen3_moe, float32, on CPU) behind
the real api and scheduler: prompt logprobs (echo, max_tokens 0 and 1) equal transformers' log-softmax of
the same checkpoint; chat top_logprobs are sorted and hold the sampled token; json_schema outputs validate
for 20 seeds, streamed and not; tool_choice required / a named function give tool_calls whose arguments
validate, and (issue 22) end after the calls with parallel calls allowed, leaking no markup into content
when max_tokens cuts a call; n: 3; a batch of prompts; logit_bias; /v1/models/{id}; a schema the grammar
engine cannot compile is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.helpers import order_model
from tests.integration.harness import REAL_WORKER_ENV, start_cluster

PROMPT = "The ferry carries the experts across the water"


@pytest.fixture(scope="module")
def real(tiny_models, tmp_path_factory):
    c = start_cluster(
        tiny_models["qwen3_moe"],
        tmp_path_factory.mktemp("features"),
        worker_flags=["--device", "cpu", "--max-model-len", "1024", "--max-prefill-tokens", "64"],
        boot="ferry.services.worker.boot:boot_worker",
        worker_env=REAL_WORKER_ENV,
    )
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(real):
    return openai.OpenAI(base_url=real.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_models):
    """log_softmax of transformers' own model of the checkpoint, float32: [P, V] for a prompt's ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_moe"], dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_models["qwen3_moe"])

    def run(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return run, tok


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_prompt_logprobs_equal_transformers_log_softmax(client, hf_logprobs, max_tokens):
    run, tok = hf_logprobs
    # long enough for two prefill chunks (--max-prefill-tokens 64) and a prefix cache hit the second time
    prompt = " ".join([PROMPT] * 12)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert len(ids) > 64
    ref = run(ids)
    for attempt in range(2):  # the second request's prefix is in the radix cache: it still gets every logprob
        r = client.completions.create(
            model="tiny", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=3, temperature=0
        )
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = lp.token_logprobs[1 : len(ids)]
        want = [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        for p in range(1, len(ids)):  # the top alternatives are transformers' top 3, most likely first
            values = list(lp.top_logprobs[p].values())
            assert values == sorted(values, reverse=True)
            assert values[0] == pytest.approx(float(ref[p - 1].max()), abs=1e-4)
        assert r.choices[0].text.startswith(prompt)
        assert r.usage.completion_tokens == max_tokens and r.usage.prompt_tokens == len(ids)
        if max_tokens == 1:  # the generated token: greedy, so the top entry's value exactly
            assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
            assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1].max()), abs=1e-4)


def test_echo_with_logprobs_streamed(client):
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0, stream=True
        )
    )
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0)
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == plain.choices[0].logprobs.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_are_sorted_and_hold_the_sampled_token(client, stream):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    if stream:
        entries = [
            e
            for c in client.chat.completions.create(**kwargs, stream=True)
            if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content
        ]
    else:
        entries = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(entries) == 8
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert (e.token, e.logprob) in [(t.token, t.logprob) for t in e.top_logprobs]  # greedy: it is the first
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token or "\ufffd" in e.token


def test_sampled_tokens_logprobs_with_temperature(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=10,
        temperature=1.0,
        seed=11,
        logprobs=True,
        top_logprobs=20,
    )
    for e in r.choices[0].logprobs.content:
        tops = {t.token: t.logprob for t in e.top_logprobs}
        assert e.token in tops and tops[e.token] == e.logprob or e.logprob <= min(tops.values())


PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "member", "role"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "member": {"type": "boolean"},
        "role": {"enum": ["captain", "crew", "passenger"]},
    },
}


async def _json_schema_outputs(base_url: str, stream: bool) -> list[tuple[str, str]]:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def one(seed: int) -> tuple[str, str]:
        kwargs = dict(
            model="tiny",
            messages=[{"role": "user", "content": "Describe a person."}],
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format=fmt,
        )
        if not stream:
            r = await client.chat.completions.create(**kwargs)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, reason = [], None
        async for c in await client.chat.completions.create(**kwargs, stream=True):
            if c.choices:
                text.append(c.choices[0].delta.content or "")
                reason = c.choices[0].finish_reason or reason
        return "".join(text), reason

    try:
        return await asyncio.gather(*(one(seed) for seed in range(20)))
    finally:
        await client.close()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_of_a_random_model_validate(real, stream):
    outputs = asyncio.run(_json_schema_outputs(real.base_url, stream))
    assert len({text for text, _ in outputs}) > 10, "20 seeds, mostly different outputs"
    for text, reason in outputs:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_output_is_an_object(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "json"}],
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "days"],
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_have_arguments_that_validate(client, choice):
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER, TIME],
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=1.0,
            seed=seed,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_forced_tool_call_streamed_as_tool_call_deltas(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=1.0,
            seed=5,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_weather"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def _forced_chat(client, stream: bool, **kwargs) -> tuple[str, list[dict], str]:
    """(content, calls as {name, arguments}, finish_reason) of one choice, streamed or not."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "What time is it?"}], temperature=1.0, **kwargs)
    if not stream:
        c = client.chat.completions.create(**kwargs).choices[0]
        calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls or []]
        return c.message.content or "", calls, c.finish_reason
    content, calls, reasons = "", [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += [{"name": t.function.name, "arguments": t.function.arguments} for t in ch.delta.tool_calls or []]
            reasons += [ch.finish_reason] if ch.finish_reason else []
    assert len(reasons) == 1
    return content, calls, reasons[0]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_parallel_tool_calls_end_after_the_calls(client, choice, stream):
    """Parallel calls allowed (the default), no max_tokens (up to the model length): a random model writes
    another call more often than not, yet the grammar lets it end after any call and makes it end after
    structured.MAX_CALLS (4) of them, which fit: every seed ends with tool_calls, content empty."""
    counts = []
    # the seeds' requests together: one batch of long outputs rather than eight in turn
    with ThreadPoolExecutor(8) as pool:
        outputs = list(
            pool.map(
                lambda seed: _forced_chat(client, stream, tools=[WEATHER, TIME], tool_choice=choice, seed=seed),
                range(8),
            )
        )
    for seed, (content, calls, reason) in enumerate(outputs):
        assert reason == "tool_calls" and content == "", (seed, content, calls)
        assert 1 <= len(calls) <= 4
        for call in calls:
            assert call["name"] == "get_time" or choice == "required"
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        counts.append(len(calls))
    assert min(counts) == 1 and max(counts) > 1, counts  # it ends after one call, or goes on: parallel calls


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_cut_by_max_tokens_leak_no_markup(client, stream):
    """max_tokens ends the output inside a call: finish_reason length, the complete calls before it
    (each valid), and neither the unfinished call nor any of its markup in content."""
    seen = set()
    cuts = [(0, 20), (0, 90), (3, 150), (5, 200), (7, 230)]
    with ThreadPoolExecutor(len(cuts)) as pool:
        outputs = list(
            pool.map(
                lambda cut: _forced_chat(
                    client, stream, tools=[WEATHER, TIME], tool_choice="required", max_tokens=cut[1], seed=cut[0]
                ),
                cuts,
            )
        )
    for content, calls, reason in outputs:
        assert "<tool_call" not in content and "tool_call>" not in content and content.strip() == "", content
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        seen.add((reason, len(calls) > 0))
    assert ("length", True) in seen and ("length", False) in seen, seen


def test_n_choices_with_distinct_seeds_and_usage(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=1.0, seed=3)
    r = client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3
    single = client.chat.completions.create(**kwargs)  # choice 0 is the request's own seed
    assert single.choices[0].message.content == texts[0]
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # one prompt, counted once
    assert r.usage.completion_tokens == 18 and r.usage.total_tokens == r.usage.prompt_tokens + 18
    streamed = {}
    for c in client.chat.completions.create(**kwargs, n=3, stream=True):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts


def test_a_batch_of_prompts_on_completions(client):
    r = client.completions.create(model="tiny", prompt=["The ferry", "Experts cross"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    one = client.completions.create(model="tiny", prompt="Experts cross", max_tokens=4, temperature=0)
    assert r.choices[2].text == r.choices[3].text == one.choices[0].text
    assert r.usage.completion_tokens == 16


def test_logit_bias_forces_a_token(client, hf_logprobs):
    _, tok = hf_logprobs
    target = tok.encode(" ferry", add_special_tokens=False)[0]
    r = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, temperature=0, logit_bias={str(target): 100}
    )
    assert r.choices[0].text == tok.decode([target] * 5)


def test_models_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


@pytest.mark.parametrize(
    "body,needle",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string", "pattern": "(?<=a)b"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools[f].function.parameters",
        ),
        ({"top_logprobs": 3}, "top_logprobs requires logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"store": True}, "store"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ],
)
def test_fields_that_cannot_be_honoured_are_400s_naming_them(client, body, needle):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, extra_body=body
        )
    assert needle in exc.value.message


# ---- issue 56 / 57: $defs in tool schemas, endless schemas, a grammar that dies ---------------------------------

ORDER_SCHEMA = order_model().model_json_schema()  # Pydantic's: the nested Item under $defs
ORDER = {"type": "function", "function": {"name": "place_order", "parameters": ORDER_SCHEMA}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "place_order"}}])
def test_forced_tool_calls_with_a_pydantic_schema_of_nested_models_validate(client, choice):
    """tool_choice required / named with parameters Pydantic wrote ($defs, refs into it), as response_format
    already took them: the call grammar resolves each tool's refs, and the arguments validate."""
    for seed in range(3):
        c = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Order bolts."}],
            tools=[ORDER, TIME],
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
        ).choices[0]  # no max_tokens: up to the model length
        assert c.finish_reason == "tool_calls", c.message
        (call,) = c.message.tool_calls
        schema = ORDER_SCHEMA if call.function.name == "place_order" else SCHEMAS[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}}
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Order"}],
        max_tokens=300,
        temperature=1.0,
        seed=0,
        response_format=fmt,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), ORDER_SCHEMA)


ENDLESS = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}  # every value nests another


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": ENDLESS}}],
                "tool_choice": "required",
            },
            "tools[f].function.parameters",
        ),
    ],
)
def test_a_schema_no_finite_value_matches_is_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=20, extra_body=body
        )
    assert exc.value.param == param and "no finite JSON value matches" in exc.value.message


# every value nests another too, but through patternProperties, which the api's check does not follow: llguidance
# compiles it, and the worker's matcher dies after "{"
DIES = {"type": "object", "required": ["a"], "patternProperties": {"^a$": {"$ref": "#"}}, "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_dies_ends_the_request_with_an_error_not_a_stop(client, stream):
    """The matcher can go no further: the request fails (a 400 naming the grammar's fields, or, streamed, an
    error event after the text so far), never a 200 with "{" and finish_reason stop."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": DIES}}
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=50, response_format=fmt)
    if not stream:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(**kwargs)
        assert "cannot go on under its grammar" in exc.value.message
        return
    chunks = []
    with pytest.raises(openai.APIError, match="cannot go on under its grammar"):
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            chunks.append(chunk)
    assert not [c for c in chunks if c.choices and c.choices[0].finish_reason], chunks
    assert client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2
    ).choices
