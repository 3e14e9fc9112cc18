"""The API's two tokenizer lanes (services/api/routes.py): a body up to LONG_BODY_BYTES is tokenized on
the short lane's thread, a larger one on the long lane's, with its own copy of the tokenizer, made on
that thread at first use (a large vocabulary's copy takes a while: never on the event loop)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from ferry.services.api.metrics import ApiMetrics
from ferry.services.api.routes import LONG_BODY_BYTES, OpenAIRoutes


class _Tokenizer:
    hf = None

    def __init__(self, name: str):
        self.name = name
        self.copied_on: list[str] = []

    def copy(self) -> "_Tokenizer":
        self.copied_on.append(threading.current_thread().name)
        return _Tokenizer(self.name + "-copy")


def _where(tokenizer, arg):
    return tokenizer.name, threading.current_thread().name, arg


def test_each_lane_tokenizes_on_its_own_thread_and_the_long_lane_copies_the_tokenizer_there_once():
    main = _Tokenizer("main")
    routes = OpenAIRoutes(SimpleNamespace(), SimpleNamespace(status=None), main, ApiMetrics())

    async def run():
        short = await routes._tokenize(_where, 1, LONG_BODY_BYTES)
        longs = [await routes._tokenize(_where, i, LONG_BODY_BYTES + 1) for i in (2, 3)]
        return short, longs

    event_loop = threading.current_thread().name
    short, longs = asyncio.run(run())
    assert short[0] == "main" and short[1].startswith("tokenizer") and not short[1].startswith("tokenizer-long")
    assert all(name == "main-copy" and thread.startswith("tokenizer-long") for name, thread, _ in longs), longs
    assert (
        len(main.copied_on) == 1 and main.copied_on[0].startswith("tokenizer-long") and main.copied_on[0] != event_loop
    )
