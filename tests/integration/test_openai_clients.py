"""The official openai client against the real three processes (worker: the PagedHashModel double,
whose greedy continuation `reference_continuation` is known exactly)."""

from __future__ import annotations

import openai
import pytest

from tests.doubles.paged_model import reference_continuation
from tests.integration.harness import ascii_word_tokens, eventually, http_get, metric


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def expected_chat(tok, messages, n):
    ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    out = reference_continuation(ids, n, ascii_word_tokens(tok))
    return len(ids), tok.decode(out, skip_special_tokens=True)


def expected_text(tok, prompt, n):
    ids = tok.encode(prompt, add_special_tokens=False)
    return len(ids), tok.decode(reference_continuation(ids, n, ascii_word_tokens(tok)), skip_special_tokens=True)


MESSAGES = [{"role": "system", "content": "You are a ferry."}, {"role": "user", "content": "Carry the experts across."}]


def test_chat_completion_greedy_output_is_the_models_continuation(client, tiny_tokenizer):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    n_prompt, text = expected_chat(tiny_tokenizer, MESSAGES, 12)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 12)


def test_chat_completion_stream_with_usage(client, tiny_tokenizer):
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    n_prompt, text = expected_chat(tiny_tokenizer, MESSAGES, 20)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == n_prompt


def test_completion_plain_and_streamed_agree(client, tiny_tokenizer):
    prompt = "The ferry carries"
    _, text = expected_text(tiny_tokenizer, prompt, 16)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == text and r.usage.completion_tokens == 16
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    )
    assert streamed == text


def test_completion_default_max_tokens_is_16(client):
    r = client.completions.create(model="tiny", prompt="Hello", temperature=0)
    assert r.usage.completion_tokens == 16


def test_stop_string_cuts_the_output_before_it(client, tiny_tokenizer):
    prompt = "Mixture of experts"
    _, text = expected_text(tiny_tokenizer, prompt, 40)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a stop string with content"
    cut = text[: text.index(stop)]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_sampling_fields_are_accepted(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=5,
        temperature=0.7,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.1,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.usage.completion_tokens == 5


def test_models_health_and_metrics(client, cluster):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert http_get(cluster.base_url + "/health")[0] == 200
    assert metric(cluster.base_url, "ferry_generation_tokens_total") > 0
    assert metric(cluster.base_url, "ferry_time_to_first_token_seconds_count") > 0
    assert metric(cluster.base_url, "ferry_kv_pages_total") == 256
    assert eventually(lambda: metric(cluster.base_url, "ferry_expert_hit_rate") == pytest.approx(0.75))
    for port in (cluster.scheduler_health_port, cluster.worker_health_port):
        status, body = http_get(f"http://127.0.0.1:{port}/health")
        assert status == 200, body
    assert "ferry_worker_steps_total" in http_get(f"http://127.0.0.1:{cluster.worker_health_port}/metrics")[1]


def test_a_repeated_prompt_reuses_cached_pages(client):
    system = "Only this test uses this harbour master prompt. " * 6  # several 16-token pages, seen nowhere else
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "first"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    messages[1]["content"] = "second"
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
