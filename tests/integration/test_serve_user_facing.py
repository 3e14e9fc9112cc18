"""`ferry serve MODEL` on the real tiny qwen3_moe model (CPU), as a user coming from vLLM runs it:
the model positional, the key in FERRY_API_KEY. The official `anthropic` client, streamed and not,
with a tool definition, gets the model's greedy output (`ferry generate`'s code, in this process)
for the prompt the chat template writes with the tools in it; the key is on no command line and
works as x-api-key; the scheduler's and the worker's /metrics answer without being asked for; the
api's /metrics has the vLLM names; every request ends in one log line (finished or aborted)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

from tests.integration.harness import REAL_WORKER_ENV, eventually, http_get, metric, serve_model
from tests.integration.test_serve_command import children_of

KEY = "serve-key-123"
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """The key in FERRY_API_KEY, as a deployment would set it; and a TMPDIR deeper than a Unix socket's path
    may be (as CI runners and pytest's own directories are): serve puts its sockets where they fit."""
    env = {**REAL_WORKER_ENV, "FERRY_API_KEY": KEY}
    deep = tmp_path_factory.mktemp("serve-real") / ("a-directory-deeper-than-a-unix-socket-path-may-be-" * 2)
    deep.mkdir()
    assert len(str(deep)) > 108
    with serve_model(tiny_models["qwen3_moe"], deep, env) as s:
        yield s


def test_anthropic_client_streamed_and_not_with_a_tool_definition(served, tiny_models, greedy_reference):
    client = anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0, timeout=120)
    greedy = {"temperature": 0}
    msg = client.messages.create(model="tiny", max_tokens=12, tools=[WEATHER], messages=ASK, extra_body=greedy)
    with client.messages.stream(
        model="tiny", max_tokens=12, tools=[WEATHER], messages=ASK, extra_body=greedy
    ) as stream:
        streamed = stream.get_final_message()
    # what the model writes for the prompt its template makes with the tool in it (a random model calls no tool)
    ref = greedy_reference["qwen3_moe"]
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"],
        },
    }
    prompt = ref.tokenizer.apply_chat_template(ASK, tools=[tool], add_generation_prompt=True, tokenize=False)
    assert '"name": "get_weather"' in prompt
    ids = ref.tokenizer.encode(prompt, add_special_tokens=False)
    out, reason = ref.ids(ids, 12, ignore_eos=False)
    for m in (msg, streamed):
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.text(out)
        assert m.stop_reason == ("max_tokens" if reason == "length" else "end_turn")
        assert m.usage.output_tokens == len(out)
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(ids)
    assert client.messages.count_tokens(model="tiny", tools=[WEATHER], messages=ASK).input_tokens == len(ids)


def test_the_key_is_on_no_command_line_and_works_as_x_api_key_or_bearer(served):
    kids = children_of(served.proc.pid)
    assert len(kids) == 3
    for pid in [served.proc.pid, *kids]:
        assert KEY not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served.url, api_key="nope", max_retries=0).models.list()  # /v1/models
    assert openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0).models.list().data[0].id == "tiny"


def test_scheduler_and_worker_metrics_are_reachable_by_default(served):
    serving = next(e for e in served.events() if e.get("event") == "serving")
    urls = serving["metrics"]
    assert set(urls) == {"api", "scheduler", "worker"}
    assert "ferry_scheduler_steps_total" in http_get(urls["scheduler"])[1]
    assert "ferry_worker_steps_total" in http_get(urls["worker"])[1]
    api = http_get(served.url + "/metrics")[1]
    for series in (
        'vllm:num_requests_running{model_name="tiny"}',
        'vllm:generation_tokens_total{model_name="tiny"}',
        'vllm:time_to_first_token_seconds_bucket{le="0.005",model_name="tiny"}',
        "ferry_preemptions_total",
        'vllm:num_preemptions_total{model_name="tiny"}',
        "# TYPE vllm:e2e_request_latency_seconds histogram",
    ):
        assert series in api, series


def test_every_request_ends_in_one_log_line_finished_or_aborted(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    client.completions.create(model="tiny", prompt="The ferry", max_tokens=3, temperature=0)
    finished = eventually(
        lambda: [
            e for e in served.events() if e.get("event") == "request_finished" and e.get("route") == "completions"
        ],
        timeout=30,
    )
    assert finished, "no request_finished line"
    line = finished[-1]
    assert line["request_id"].startswith("cmpl-") and line["completion_tokens"] == 3 and line["outcome"] == "length"
    assert line["ttft_s"] > 0 and line["prompt_tokens"] > 0 and line["process"] == "api"
    # a client that leaves mid-stream: the request is aborted, and says so
    body = json.dumps(
        {"model": "tiny", "prompt": "Leaving early", "max_tokens": 400, "stream": True, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        served.url + "/v1/completions",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read(64)  # the stream has begun
    aborted = eventually(lambda: [e for e in served.events() if e.get("event") == "request_aborted"], timeout=20)
    assert aborted and aborted[-1]["outcome"] == "disconnected" and aborted[-1]["completion_tokens"] < 400, aborted
    assert eventually(lambda: metric(served.url, "ferry_running_requests") == 0, timeout=10)
