"""OpenAI request bodies -> validated fields and SamplingParams."""

from __future__ import annotations

import json

import pytest

from ferry.shared.errors import InvalidRequest
from ferry.shared.sampling import SamplingParams
from ferry.services.api import schema


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return schema.decode_body(json.dumps(body).encode(), schema.ChatCompletionRequest)


def test_sampling_fields_reach_sampling_params_and_eos_is_a_stop_token():
    req = chat(temperature=0.3, top_p=0.8, top_k=-1, min_p=0.1, seed=5, repetition_penalty=1.2,
               presence_penalty=0.4, frequency_penalty=-0.2, stop_token_ids=[7])  # fmt: skip
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


@pytest.mark.parametrize("prompt,expected", [("hi", "hi"), ([1, 2], [1, 2]), (["hi"], "hi"), ([[3, 4]], [3, 4])])
def test_completion_prompt_forms(prompt, expected):
    req = schema.decode_body(json.dumps({"prompt": prompt}).encode(), schema.CompletionRequest)
    assert schema.completion_prompt(req) == expected


def test_a_batch_of_prompts_is_refused():
    req = schema.decode_body(b'{"prompt": ["a", "b"]}', schema.CompletionRequest)
    with pytest.raises(InvalidRequest, match="batch of 2"):
        schema.completion_prompt(req)


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 1.5), ("min_p", 2), ("top_k", -3),
                                         ("presence_penalty", 3), ("repetition_penalty", 0)])  # fmt: skip
def test_out_of_range_sampling_fields_are_named(field, value):
    req = chat(**{field: value})
    with pytest.raises(InvalidRequest, match=field):
        schema.sampling_params(req, eos_token_ids=())


def test_sampling_fields_not_sent_take_sampling_params_defaults():
    assert schema.sampling_params(chat(temperature=None), eos_token_ids=()) == SamplingParams()


def test_more_than_one_choice_is_refused():
    with pytest.raises(InvalidRequest, match="n must be 1"):
        schema.validate_generation(chat(n=3), None)


def test_wrong_type_error_names_the_json_path():
    with pytest.raises(InvalidRequest, match=r"\$\.stream"):
        chat(stream="yes please")
