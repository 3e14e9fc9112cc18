"""Heavy requests hold up no other, against the real api, scheduler and worker processes (issue 57, items 3
and 4): a small schema is built before large ones that compile for seconds, a schema over the size cap is
refused at once naming its field, and a plain completion is answered while large bodies decode. In process:
tests/unit/test_grammar_lanes.py and test_body_decoding.py."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from tests.integration.harness import http_get

MSG = [{"role": "user", "content": "hi"}]


def post(base_url: str, path: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        base_url + path, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _concurrently(base_url: str, bodies: dict[str, dict | bytes], start_last_after: float = 0.0) -> dict[str, tuple]:
    """Each body posted on its own thread, the last one `start_last_after` seconds after the others;
    {name: (status, payload, when it was answered, seconds it took)}."""
    done: dict[str, tuple] = {}

    def send(name: str, body) -> None:
        t0 = time.monotonic()
        status, payload = post(base_url, "/v1/chat/completions", body)
        done[name] = (status, payload, time.monotonic(), time.monotonic() - t0)

    *firsts, last = bodies.items()
    threads = [threading.Thread(target=send, args=item) for item in firsts]
    for t in threads:
        t.start()
    time.sleep(start_last_after)
    send(*last)
    for t in threads:
        t.join(120)
    return done


def test_a_small_schema_is_built_before_large_forced_tool_schemas_compiling(cluster):
    """Eight forced calls whose first tool's schema (500 formatted properties, 87 KB) compiles for about half a
    second and whose second the engine cannot use (a 400 naming it); a small json_schema request sent after
    them is answered before at least half of them: it waits on another lane (on one lane, after them all)."""
    slow = {
        "type": "object",
        "required": [f"p{i}" for i in range(500)],
        "properties": {
            f"p{i}": {
                "type": "string",
                "format": ["email", "date-time", "uuid", "uri"][i % 4],
                "description": "d" * 100,
            }
            for i in range(500)
        },
    }
    bad = {"type": "string", "pattern": "(?<=a)b"}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in (("slow", slow), ("bad", bad))]
    large = {"messages": MSG, "max_tokens": 2, "tools": tools, "tool_choice": "required"}
    small = {
        "messages": MSG,
        "max_tokens": 2,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        },
    }
    post(cluster.base_url, "/v1/chat/completions", small)  # warm: the first request pays for imports
    larges = [f"large{i}" for i in range(8)]
    done = _concurrently(cluster.base_url, {**{name: large for name in larges}, "small": small}, 0.2)
    assert done["small"][0] == 200, done["small"]
    for name in larges:
        status, payload, *_ = done[name]
        assert status == 400 and payload["error"]["param"] == "tools[bad].function.parameters", payload
    after_small = [name for name in larges if done[name][2] > done["small"][2]]
    first = min(when for _, _, when, _ in done.values())
    assert len(after_small) >= 4, {name: round(when - first, 3) for name, (_, _, when, _) in done.items()}


def test_a_schema_over_the_size_cap_is_refused_at_once_naming_its_field(cluster):
    huge = {
        "type": "object",
        "properties": {f"p{i:05d}": {"type": "string", "description": "d" * 80} for i in range(16_000)},
    }  # 1.78 MB
    body = {
        "messages": MSG,
        "max_tokens": 2,
        "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": huge}}],
    }
    status, payload = post(cluster.base_url, "/v1/chat/completions", body)
    assert status == 400 and payload["error"]["param"] == "tools[f].function.parameters", payload
    assert "at most 1,048,576" in payload["error"]["message"], payload


def test_a_plain_completion_is_answered_while_large_bodies_decode(cluster):
    """Eight 2.6 MB response_format bodies (each a 400: the schema is over the cap) and a plain completion sent
    while they are decoded: it is answered within a generous bound (it took 10 ms here; 5 s with the bodies
    decoded on the event loop), and all of them are refused naming the field."""
    props = {
        f"field_{i:06d}": {"type": "string", "enum": [f"v{i}a", f"v{i}b"], "description": "x" * 20}
        for i in range(24_000)
    }
    large = json.dumps(
        {
            "messages": MSG,
            "max_tokens": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": props}},
            },
        }
    ).encode()
    assert len(large) > 2_500_000
    plain = {"messages": MSG, "max_tokens": 2}
    post(cluster.base_url, "/v1/chat/completions", plain)
    done = _concurrently(cluster.base_url, {**{f"large{i}": large for i in range(8)}, "plain": plain}, 0.2)
    assert done["plain"][0] == 200 and done["plain"][3] < 2.5, done["plain"]
    for name in (f"large{i}" for i in range(8)):
        status, payload, *_ = done[name]
        assert status == 400 and payload["error"]["param"] == "response_format.json_schema.schema", payload
    assert http_get(cluster.base_url + "/health")[0] == 200
