"""The grammar lanes (services/api/grammar_lanes.py): a small schema is built while large ones compile, a
schema over the size cap is a 400 naming its field before any work, one over the time budget a 400 naming
it too, a request that left is not compiled, and a full lane is a 503. Waits are bounded to fail, not timed."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from ferry.services.api import grammar_lanes, structured
from ferry.services.api.grammar_lanes import MAX_SCHEMA_BYTES, SMALL_SCHEMA_BYTES, GrammarBusy, GrammarLanes
from ferry.services.api.metrics import ApiMetrics
from ferry.shared.errors import InvalidRequest

FIELD = "response_format.json_schema.schema"
MSG = [{"role": "user", "content": "hi"}]


def _schema(nbytes: int) -> dict:
    """An object schema of about `nbytes` bytes as JSON (quick to compile: its size is in descriptions)."""
    return {"type": "object", "properties": {"a": {"type": "string", "description": "x" * nbytes}}}


def _json_schema_body(schema: dict) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"messages": MSG, "max_tokens": 2, "response_format": fmt}


@pytest.fixture
def api_app(tiny_tokenizer_dir, tmp_path):
    """The api's real app (no scheduler behind its socket: a request whose grammar is built ends in a 503)."""
    from ferry.services.api.app import build_app
    from ferry.services.api.config import ApiConfig
    from ferry.services.api.tokenizer import PromptTokenizer

    cfg = ApiConfig(
        host="127.0.0.1",
        port=0,
        scheduler_addr=f"ipc://{tmp_path}/api.sock",
        tokenizer=str(tiny_tokenizer_dir),
        served_model_name="tiny",
        api_key=None,
        max_body_bytes=4 * 2**20,
        identity="api-test",
    )
    return build_app(cfg, PromptTokenizer(str(tiny_tokenizer_dir)))


def test_a_small_schema_is_built_while_large_ones_compile(api_app, monkeypatch):
    """Four requests with large schemas hold their compilations (until released); a small json_schema request
    sent after them is answered meanwhile: it waits behind none of them."""
    release, compiling = threading.Event(), threading.Semaphore(0)
    order = []
    real = structured.response_format_grammar

    def held_if_large(fmt):
        if len(json.dumps(fmt.json_schema.schema)) > SMALL_SCHEMA_BYTES:
            compiling.release()
            release.wait(30)  # bounded, so that the test fails rather than hangs
            order.append("large compiled")
        return real(fmt)

    monkeypatch.setattr(structured, "response_format_grammar", held_if_large)

    async def run():
        client = TestClient(TestServer(api_app))
        await client.start_server()
        try:
            large = _json_schema_body(_schema(SMALL_SCHEMA_BYTES + 1))
            bigs = [asyncio.ensure_future(client.post("/v1/chat/completions", json=large)) for _ in range(4)]
            await asyncio.to_thread(compiling.acquire, timeout=30)  # a large one is compiling
            small = await asyncio.wait_for(client.post("/v1/chat/completions", json=_json_schema_body(_schema(10))), 20)
            order.append("small answered")
            release.set()
            statuses = [(await b).status for b in bigs]
            return small.status, statuses
        finally:
            release.set()
            await client.close()

    small, statuses = asyncio.run(run())
    assert order[0] == "small answered" and small == 503, (order, small)  # built, then refused: no scheduler
    assert statuses == [503] * 4, statuses


def test_a_schema_over_the_cap_is_a_400_naming_its_field_before_any_work():
    called = []
    lanes = GrammarLanes(ApiMetrics())

    async def run():
        await lanes.build(called.append, None, [("tools[f].function.parameters", _schema(MAX_SCHEMA_BYTES))], "tools")

    with pytest.raises(InvalidRequest, match=r"tools\[f\]\.function\.parameters: the schema is") as err:
        asyncio.run(run())
    assert err.value.param == "tools[f].function.parameters" and called == []


def test_the_routes_refuse_an_oversized_schema_naming_its_field(api_app):
    async def run():
        client = TestClient(TestServer(api_app))
        await client.start_server()
        try:
            r = await client.post("/v1/chat/completions", json=_json_schema_body(_schema(MAX_SCHEMA_BYTES)))
            return r.status, await r.json()
        finally:
            await client.close()

    status, body = asyncio.run(run())
    assert status == 400 and body["error"]["param"] == FIELD, body


def test_a_grammar_over_the_time_budget_is_a_400_naming_the_largest_schema_and_keeps_its_place_till_done():
    release, done = threading.Event(), threading.Event()
    lanes = GrammarLanes(ApiMetrics(), budget_s=0.05)

    def stuck(arg):
        release.wait(30)
        done.set()
        return "grammar"

    schemas = [("tools[a].input_schema", _schema(10)), ("tools[b].input_schema", _schema(100))]

    async def run():
        with pytest.raises(InvalidRequest) as err:
            await lanes.build(stuck, None, schemas, "tools")
        held = lanes.lanes["small"].jobs
        release.set()
        await asyncio.to_thread(done.wait, 30)
        return err.value, held

    error, held = asyncio.run(run())
    assert error.param == "tools[b].input_schema" and "within 0.05 s" in str(error), error
    assert held == 1  # its thread still compiles: the lane counts it until it is done


def test_a_request_that_left_before_its_turn_is_not_compiled_and_a_full_lane_is_a_503(monkeypatch):
    monkeypatch.setitem(grammar_lanes.LANES, "large", (1, 2))
    lanes = GrammarLanes(ApiMetrics())
    release, started = threading.Event(), threading.Event()
    ran = []

    def held(arg):
        ran.append(arg)
        started.set()
        release.wait(30)
        return arg

    large = [("f", _schema(SMALL_SCHEMA_BYTES + 1))]

    async def run():
        first = asyncio.ensure_future(lanes.build(held, "first", large, "tools"))
        await asyncio.to_thread(started.wait, 30)
        second = asyncio.ensure_future(lanes.build(held, "second", large, "tools"))
        await asyncio.sleep(0)
        with pytest.raises(GrammarBusy):
            await lanes.build(held, "third", large, "tools")  # two waiting or running: the lane is full
        second.cancel()  # its client left while it waited
        await asyncio.gather(second, return_exceptions=True)
        release.set()
        result = await first
        await asyncio.to_thread(lanes.lanes["large"].executor.submit(lambda: None).result, 30)
        return result, second.cancelled()

    result, cancelled = asyncio.run(run())
    assert result == "first" and cancelled and ran == ["first"], ran
    assert lanes.lanes["large"].jobs == 0, lanes.lanes["large"].jobs
