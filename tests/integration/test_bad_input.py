"""Bad requests get a 400 (or 401/404/413) with an OpenAI error object, and the server keeps serving."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.integration.harness import http_get


def post(base_url: str, path: str, body: bytes | str | dict, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(
        base_url + path, data=data, method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


MSG = [{"role": "user", "content": "hi"}]
CASES = [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", b"", "body is empty"),
    ("/v1/chat/completions", {"messages": "hi"}, "$.messages"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": "ten"}, "$.max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, "$.temperature"),
    ("/v1/chat/completions", {"messages": []}, "messages must not be empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, "content must not be empty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role must be one of"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, "max_tokens must be at least 1"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": -5}, "max_tokens must be at least 1"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 100000}, "exceeds the model length 512"),
    ("/v1/chat/completions", {"messages": MSG, "n": 17}, "n must be in [1, 16]"),
    ("/v1/chat/completions", {"messages": MSG, "functions": [{"name": "f"}]}, "functions: the deprecated"),
    ("/v1/completions", {"prompt": "hi", "suffix": "bye"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "0 only scores the prompt, with echo"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs must be in [0, 20]"),
    ("/v1/chat/completions", {"messages": MSG, "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": ""}, "prompt must not be empty"),
    ("/v1/completions", {"prompt": "hello " * 600, "max_tokens": 1}, "model length is 512"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 100000}, "exceeds the model length"),
]


@pytest.mark.parametrize("path,body,needle", CASES)
def test_bad_request_gets_400_with_an_openai_error(cluster, path, body, needle):
    status, payload = post(cluster.base_url, path, body)
    assert status == 400, payload
    err = payload["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"], err


def test_unknown_model_is_404_and_unknown_route_is_a_json_404(cluster):
    status, payload = post(cluster.base_url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and "gpt-9" in payload["error"]["message"]
    status, body = http_get(cluster.base_url + "/v1/nothing")
    assert status == 404 and "error" in json.loads(body)


def test_server_keeps_serving_after_bad_requests(cluster):
    for path, body, _ in CASES[:5]:
        post(cluster.base_url, path, body)
    status, payload = post(cluster.base_url, "/v1/completions", {"prompt": "hello", "max_tokens": 3})
    assert status == 200 and payload["usage"]["completion_tokens"] == 3
    assert http_get(cluster.base_url + "/health")[0] == 200


def test_every_log_line_is_one_json_object_and_api_events_carry_request_ids(cluster):
    post(cluster.base_url, "/v1/completions", {"prompt": "log me", "max_tokens": 2})
    post(cluster.base_url, "/v1/completions", b"{broken")
    logs = {
        name: [json.loads(line) for line in cluster.log(name).splitlines() if line.strip()]
        for name in ("api", "scheduler", "worker")
    }  # json.loads raises on any non-JSON line
    assert any(e["event"] == "worker_ready" for e in logs["worker"])
    assert any(e["event"] == "worker_ready" for e in logs["scheduler"])
    events = logs["api"]
    # this test's completions (the cluster is shared: other modules' chat requests may be in the log too)
    finished = [e for e in events if e["event"] == "request_finished" and e["route"] == "completions"]
    assert finished and all(e["request_id"].startswith("cmpl-") and e["process"] == "api" for e in finished)


def test_every_refused_request_is_counted_by_route_and_status(cluster):
    from tests.integration.harness import labelled_metric

    def count(route: str, status: int) -> float:
        return labelled_metric(cluster.base_url, "ferry_refused_requests_total", route=route, status=str(status))

    before = {
        k: count(*k)
        for k in [
            ("/v1/chat/completions", 400),
            ("/v1/completions", 404),
            ("unmatched", 404),
            ("/v1/completions", 405),
            ("/v1/completions", 413),
        ]
    }
    post(cluster.base_url, "/v1/chat/completions", b"{not json")  # 400 from validation
    post(cluster.base_url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 100000})  # 400 from the scheduler
    post(cluster.base_url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})  # 404 unknown model
    http_get(cluster.base_url + "/v1/nothing")  # 404 unknown route
    http_get(cluster.base_url + "/v1/completions")  # 405 wrong method
    post(cluster.base_url, "/v1/completions", {"prompt": "x" * (5 * 2**20)})  # 413 over --max-body-size (4MiB)
    after = {k: count(*k) for k in before}
    assert {k: after[k] - before[k] for k in before} == {
        ("/v1/chat/completions", 400): 2,
        ("/v1/completions", 404): 1,
        ("unmatched", 404): 1,
        ("/v1/completions", 405): 1,
        ("/v1/completions", 413): 1,
    }


LONG = "hello " * 400  # about 400 tokens of the tiny tokenizer: with max_tokens 200, past the model length (512)


@pytest.mark.parametrize(
    "kind,body,param",
    [
        ("chat", {"messages": MSG, "max_tokens": 100000}, "max_tokens"),
        ("chat", {"messages": MSG, "max_completion_tokens": 100000}, "max_completion_tokens"),
        ("chat", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 200}, "max_tokens"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hello " * 600}]},
            "messages",
        ),  # the prompt alone is too long
        ("completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens"),
        ("completions", {"prompt": "hello " * 600, "max_tokens": 1}, "prompt"),
        ("chat", {"messages": MSG, "temperature": 2.5}, "temperature"),
        ("completions", {"prompt": "hi", "temperature": 2.01}, "temperature"),
    ],
)
def test_over_length_and_out_of_range_400s_name_the_field_to_change(cluster, kind, body, param):
    """Through the official client: the error's param is the field to change (the scheduler's refusals of
    prompt + max_tokens past the model length too, named as the body names them)."""
    import openai

    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    with pytest.raises(openai.BadRequestError) as exc:
        create(model="tiny", **body)
    assert exc.value.param == param, exc.value.message
    assert exc.value.body["type"] == "invalid_request_error"
