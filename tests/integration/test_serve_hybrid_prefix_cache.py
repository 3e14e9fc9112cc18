"""The prefix cache of a hybrid model through `ferry serve` (the real tiny qwen3_5_moe on CPU: Gated DeltaNet
layers, whose state at a cached prefix's end comes from a linear-state snapshot): a conversation's later
turns report cached prompt tokens through the official openai and anthropic clients, and still give the
greedy output of a full recompute (`ferry generate`'s code in this process, no cache); n > 1 computes the
prompt once; /metrics counts the prefix hits and holds the snapshots."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.integration.harness import REAL_WORKER_ENV, eventually, http_get, metric, serve_model

ARCH = "qwen3_5_moe"
SYSTEM = (
    "You are the harbour master of a small river port. Answer every question about the ferries, their "
    "timetables and their cargo in one short sentence."
)


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    with serve_model(tiny_models[ARCH], tmp_path_factory.mktemp("serve-hybrid"), REAL_WORKER_ENV) as s:
        yield s


def scheduler_metrics(served) -> str:
    return next(e for e in served.events() if e.get("event") == "serving")["metrics"]["scheduler"].removesuffix(
        "/metrics"
    )


def test_a_three_turn_conversation_reuses_its_prefix_and_keeps_the_greedy_output(served, greedy_reference):
    ref = greedy_reference[ARCH]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "Only this test says: " + SYSTEM}]
    cached = []
    for question in ("Which ferry leaves first?", "And what does it carry?", "When does it come back?"):
        messages.append({"role": "user", "content": question})
        prompt = ref.chat_ids(messages)
        ids, reason = ref.ids(prompt, 10, ignore_eos=False)  # a full recompute, alone
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ref.text(ids), reason), question
        assert r.usage.prompt_tokens == len(prompt)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < len(prompt) and cached[-1] % 16 == 0
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    # the first turn computes everything; the later ones start from the turn before's snapshots
    assert cached[0] == 0 and cached[1] >= 32 and cached[2] > cached[1]


def test_the_anthropic_client_reads_the_cached_prefix_in_its_usage(served, greedy_reference):
    ref = greedy_reference[ARCH]
    client = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0, timeout=120)
    system = "Only the anthropic test says: " + SYSTEM
    messages = [{"role": "user", "content": "Which ferry leaves first?"}]
    greedy = {"temperature": 0}
    first = client.messages.create(model="tiny", max_tokens=8, system=system, messages=messages, extra_body=greedy)
    assert first.usage.cache_read_input_tokens == 0
    messages += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "Why?"}]
    second = client.messages.create(model="tiny", max_tokens=8, system=system, messages=messages, extra_body=greedy)
    prompt = ref.chat_ids([{"role": "system", "content": system}, *messages])
    ids, _ = ref.ids(prompt, 8, ignore_eos=False)
    assert second.content[0].text == ref.text(ids)
    u = second.usage
    assert u.cache_read_input_tokens >= 32 and u.cache_creation_input_tokens == 0
    assert u.input_tokens + u.cache_read_input_tokens == len(prompt)


def test_n_choices_compute_the_prompt_once_and_the_metrics_count_the_hits(served, greedy_reference):
    ref = greedy_reference[ARCH]
    sched = scheduler_metrics(served)
    hits = metric(sched, "ferry_scheduler_prefix_hits_total")
    messages = [
        {"role": "system", "content": "Only the choices test says: " + SYSTEM},
        {"role": "user", "content": "Name a ferry."},
    ]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, n=3)
    ids, _ = ref.ids(ref.chat_ids(messages), 6, ignore_eos=False)
    assert [c.message.content for c in r.choices] == [ref.text(ids)] * 3
    # two of the three started from the first one's snapshot of the prompt
    assert eventually(lambda: metric(sched, "ferry_scheduler_prefix_hits_total") >= hits + 2, timeout=9)
    assert metric(sched, "ferry_scheduler_state_snapshots") > 0
    assert eventually(lambda: metric(served.url, "ferry_prefix_cache_hits_total") >= hits + 2, timeout=9)
    api = http_get(served.url + "/metrics")[1]
    assert "ferry_state_snapshot_evictions_total" in api and metric(served.url, "ferry_state_snapshots") > 0
