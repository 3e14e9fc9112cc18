"""OpenAI request bodies -> validated fields and SamplingParams."""

from __future__ import annotations

import json

import pytest

from ferry.services.api import schema
from ferry.shared.errors import InvalidRequest
from ferry.shared.sampling import SamplingParams


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return schema.decode_body(json.dumps(body).encode(), schema.ChatCompletionRequest)


def test_sampling_fields_reach_sampling_params_and_eos_is_a_stop_token():
    req = chat(
        temperature=0.3,
        top_p=0.8,
        top_k=-1,
        min_p=0.1,
        seed=5,
        repetition_penalty=1.2,
        presence_penalty=0.4,
        frequency_penalty=-0.2,
        stop_token_ids=[7],
    )
    p = schema.sampling_params(req, eos_token_ids=(2,))
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.3, 0.8, -1, 0.1, 5)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.4, -0.2)
    assert p.stop_token_ids == (7, 2)


def test_ignore_eos_drops_the_eos_stop_token():
    assert schema.sampling_params(chat(ignore_eos=True), eos_token_ids=(2,)).stop_token_ids == ()


def test_max_completion_tokens_wins_over_max_tokens_and_absent_means_model_length():
    assert schema.chat_max_tokens(chat(max_tokens=5, max_completion_tokens=9)) == 9
    assert schema.chat_max_tokens(chat()) is None


def test_content_parts_are_joined_and_images_refused():
    req = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert schema.chat_messages(req) == [{"role": "user", "content": "ab"}]
    req = chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(InvalidRequest, match=r"messages\[0\].content\[0\]"):
        schema.chat_messages(req)


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("hi", ["hi"]),
        ([1, 2], [[1, 2]]),
        (["hi"], ["hi"]),
        ([[3, 4]], [[3, 4]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    req = schema.decode_body(json.dumps({"prompt": prompt}).encode(), schema.CompletionRequest)
    assert schema.completion_prompts(req) == expected


def test_a_batch_mixing_ids_and_texts_is_refused():
    req = schema.decode_body(b'{"prompt": ["a", 5]}', schema.CompletionRequest)
    with pytest.raises(InvalidRequest, match="mixes token ids and texts"):
        schema.completion_prompts(req)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("top_p", 1.5),
        ("min_p", 2),
        ("top_k", -3),
        ("presence_penalty", 3),
        ("repetition_penalty", 0),
    ],
)
def test_out_of_range_sampling_fields_are_named(field, value):
    req = chat(**{field: value})
    with pytest.raises(InvalidRequest, match=field):
        schema.sampling_params(req, eos_token_ids=())


def test_sampling_fields_not_sent_take_sampling_params_defaults():
    assert schema.sampling_params(chat(temperature=None), eos_token_ids=()) == SamplingParams()


def test_n_is_bounded():
    schema.validate_generation(chat(n=3), None)
    with pytest.raises(InvalidRequest, match=r"n must be in \[1, 16\]"):
        schema.validate_generation(chat(n=0), None)


# every OpenAI field that this server cannot honour, with a value that asks for it: a 400 naming the field
REFUSED = [
    ("metadata", {"k": "v"}),
    ("store", True),
    ("service_tier", "flex"),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("audio", {"voice": "alloy"}),
    ("prediction", {"type": "content"}),
    ("web_search_options", {}),
    ("verbosity", "high"),
    ("modalities", ["text", "audio"]),
    ("reasoning_effort", "maximal"),
]


@pytest.mark.parametrize("field,value", REFUSED)
def test_fields_that_cannot_be_honoured_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequest, match=field):
        schema.validate_generation(chat(**{field: value}), None)


@pytest.mark.parametrize(
    "field,value",
    [
        ("store", False),
        ("service_tier", "auto"),
        ("modalities", ["text"]),
        ("verbosity", "medium"),
        ("reasoning_effort", "low"),
        ("user", "u1"),
        ("prompt_cache_key", "k"),
        ("safety_identifier", "s"),
    ],
)
def test_values_that_ask_for_nothing_new_are_taken(field, value):
    schema.validate_generation(chat(**{field: value}), None)


def test_completion_fields_suffix_and_best_of():
    def completion(**body):
        return schema.decode_body(json.dumps({"prompt": "x", **body}).encode(), schema.CompletionRequest)

    with pytest.raises(InvalidRequest, match="suffix"):
        schema.validate_generation(completion(suffix="y"), 16)
    with pytest.raises(InvalidRequest, match="best_of"):
        schema.validate_generation(completion(best_of=2), 16)
    schema.validate_generation(completion(best_of=2, n=2), 16)


def test_logit_bias_and_logprobs_reach_sampling_params():
    p = schema.sampling_params(chat(logit_bias={"5": -100, "7": 2.5}), eos_token_ids=(), vocab_size=10, logprobs=3)
    assert p.logit_bias == ((5, -100.0), (7, 2.5)) and p.logprobs == 3
    with pytest.raises(InvalidRequest, match="logit_bias"):
        schema.sampling_params(chat(logit_bias={"12": 1}), eos_token_ids=(), vocab_size=10)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        schema.sampling_params(chat(logit_bias={"1": 101}), eos_token_ids=(), vocab_size=10)


def test_chat_logprobs_fields():
    assert schema.chat_logprobs(chat()) is None
    assert schema.chat_logprobs(chat(logprobs=True)) == 0
    assert schema.chat_logprobs(chat(logprobs=True, top_logprobs=4)) == 4
    with pytest.raises(InvalidRequest, match="requires logprobs"):
        schema.chat_logprobs(chat(top_logprobs=4))


def test_tool_messages_and_assistant_calls_reach_the_template():
    req = chat(
        messages=[
            {"role": "user", "content": "w?"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
    )
    msgs = schema.chat_messages(req)
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert msgs[2] == {"role": "tool", "content": "ok", "tool_call_id": "c1"}


def test_wrong_type_error_names_the_json_path():
    with pytest.raises(InvalidRequest, match=r"\$\.stream"):
        chat(stream="yes please")


@pytest.mark.parametrize("value", [2.5, 2.0001, -0.1])
def test_temperature_outside_openais_range_is_refused_naming_it(value):
    """OpenAI's temperature is in [0, 2] (the engine alone takes any value >= 0)."""
    with pytest.raises(InvalidRequest, match=r"temperature must be in \[0, 2\]") as exc:
        schema.validate_generation(chat(temperature=value), None)
    assert exc.value.param == "temperature"
    schema.validate_generation(chat(temperature=2), None)
    schema.validate_generation(chat(temperature=0), None)


def test_the_scheduler_s_fields_are_named_as_the_body_names_them():
    """A refusal by the scheduler names its Submit field (prompt, max_tokens); the chat body's are messages and
    max_tokens or max_completion_tokens, whichever was sent; completions' are its own."""
    assert schema.submit_fields(chat(max_tokens=5)) == {"prompt": "messages", "max_tokens": "max_tokens"}
    assert schema.submit_fields(chat(max_completion_tokens=5))["max_tokens"] == "max_completion_tokens"
    assert schema.submit_fields(schema.decode_body(b'{"prompt": "hi"}', schema.CompletionRequest)) == {}
