"""Large request bodies decode off the event loop (services/api/body_decoding.py): a plain request is answered
while they decode, on every route that reads a body, and too many waiting get a 503. Waits are bounded to
fail, not timed."""

from __future__ import annotations

import asyncio
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer

from ferry.services.api import body_decoding, schema
from ferry.services.api.body_decoding import LARGE_BODY_BYTES, BodyDecoder, DecoderBusy

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
def api_app(tiny_tokenizer_dir, tmp_path):
    """The api's real app (no scheduler behind its socket: a request that gets that far ends in a 503)."""
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


def _large_body(route: str) -> dict:
    schema_ = {"type": "object", "properties": {"a": {"type": "string", "description": "x" * LARGE_BODY_BYTES}}}
    if route == "/v1/messages":
        return {"model": "tiny", "max_tokens": 2, "messages": MSG, "tools": [{"name": "f", "input_schema": schema_}]}
    return {
        "messages": MSG,
        "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema_}},
    }


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_a_plain_request_is_answered_while_large_bodies_decode(api_app, monkeypatch, route):
    """Large bodies whose decoding is held (until released): a small completion sent meanwhile is answered."""
    release, decoding = threading.Event(), threading.Semaphore(0)
    order = []
    real = schema.decode_body

    def held_if_large(body, kind):
        if len(body) > LARGE_BODY_BYTES:
            decoding.release()
            release.wait(10)  # bounded, so that the test fails rather than hangs
            order.append("large decoded")
        return real(body, kind)

    monkeypatch.setattr(schema, "decode_body", held_if_large)

    async def run():
        client = TestClient(TestServer(api_app))
        await client.start_server()
        try:
            bigs = [asyncio.ensure_future(client.post(route, json=_large_body(route))) for _ in range(4)]
            await asyncio.to_thread(decoding.acquire, timeout=20)  # a large body is decoding
            small = await asyncio.wait_for(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}), 20)
            order.append("small answered")
            release.set()
            statuses = [(await b).status for b in bigs]
            return small.status, statuses
        finally:
            release.set()
            await client.close()

    small, statuses = asyncio.run(run())
    assert order[0] == "small answered" and small == 503, (order, small)  # decoded, then refused: no scheduler
    assert all(status in (400, 503) for status in statuses), statuses  # the anthropic route: no such model


def test_small_bodies_decode_on_the_loop_and_too_many_large_ones_waiting_are_a_503(monkeypatch):
    monkeypatch.setattr(body_decoding, "MAX_LARGE_BODIES", 1)
    decoder = BodyDecoder()
    release, decoding = threading.Event(), threading.Event()
    threads = []
    real = schema.decode_body

    def held(body, kind):
        threads.append(threading.current_thread().name)
        if len(body) > LARGE_BODY_BYTES:
            decoding.set()
            release.wait(30)
        return real(body, kind)

    monkeypatch.setattr(schema, "decode_body", held)
    large = b'{"prompt": "' + b"x" * LARGE_BODY_BYTES + b'"}'

    async def run():
        first = asyncio.ensure_future(decoder.decode(large, schema.CompletionRequest))
        await asyncio.to_thread(decoding.wait, 30)
        with pytest.raises(DecoderBusy):
            await decoder.decode(large, schema.CompletionRequest)
        small = await decoder.decode(b'{"prompt": "hi"}', schema.CompletionRequest)
        release.set()
        return (await first).prompt, small.prompt

    loop_thread = threading.current_thread().name
    assert asyncio.run(run()) == ("x" * LARGE_BODY_BYTES, "hi")
    assert threads[0].startswith("body-decoder") and threads[1] == loop_thread, threads
