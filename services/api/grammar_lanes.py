"""Where the api builds and checks a request's grammar (structured.py), off the event loop, by size.

llguidance compiles a grammar (its lexer and parser: most of the work, up to seconds for a schema of
thousands of properties or formats) with the GIL released, so threads compile beside the event loop
and beside each other; turning a schema into a grammar holds the GIL (about 0.05 s a MiB).

* Lanes by size: a request whose schemas are SMALL_SCHEMA_BYTES or less in all (as JSON) compiles on
  the small lane's threads, a larger one on the large lane's, so a small schema never waits behind a
  large one, however many large ones queue.
* Bounded per request: a schema over MAX_SCHEMA_BYTES is a 400 naming its field, before any work;
  one whose grammar is not built GRAMMAR_BUDGET_S after its thread started on it is a 400 naming it
  too. That thread cannot be stopped: it finishes (llguidance's own limits bound for how long) and
  keeps its place in the lane until then. A request that leaves before its turn is not compiled.
* Bounded queues: each lane takes at most so many jobs waiting or running; more get a 503 with
  Retry-After.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from ferry.shared.errors import InvalidRequest, ServiceUnavailable

SMALL_SCHEMA_BYTES = 16 * 1024  # the costliest found at this size (formatted strings) compiles in well under a second
MAX_SCHEMA_BYTES = 1024 * 1024  # OpenAI's strict schemas (5,000 properties, 120,000 characters of names) fit well below
GRAMMAR_BUDGET_S = 10.0
LANES = {"small": (2, 64), "large": (2, 8)}  # lane: (threads, jobs waiting or running at most)


class GrammarBusy(ServiceUnavailable):
    retry_after = 1


@dataclass
class _Lane:
    name: str
    executor: ThreadPoolExecutor
    max_jobs: int
    jobs: int = 0  # waiting or running: released when the thread is done with one, not when its request is
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self) -> bool:
        with self.lock:
            if self.jobs >= self.max_jobs:
                return False
            self.jobs += 1
            return True

    def release(self, _future: Future) -> None:
        with self.lock:
            self.jobs -= 1


def schema_fields(schemas: list[tuple[str, Any]]) -> list[tuple[str, int]]:
    """[(field, size in bytes as JSON)] of `schemas` [(field, schema)]; a 400 naming the first over
    MAX_SCHEMA_BYTES."""
    sizes = [(name, len(msgspec.json.encode(schema))) for name, schema in schemas]
    for name, size in sizes:
        if size > MAX_SCHEMA_BYTES:
            raise InvalidRequest(
                f"{name}: the schema is {size:,} bytes as JSON; at most {MAX_SCHEMA_BYTES:,} are accepted", param=name
            )
    return sizes


def response_format_schemas(fmt) -> list[tuple[str, Any]]:
    """[(field, schema)] that `response_format` (schema.ResponseFormat) compiles (json_object: none)."""
    if fmt.type == "json_schema" and fmt.json_schema is not None and fmt.json_schema.schema is not None:
        return [("response_format.json_schema.schema", fmt.json_schema.schema)]
    return []


def tool_schemas(tools: list[tuple[str, Any]], field: str) -> list[tuple[str, Any]]:
    """[(field, schema)] of forced tools [(name, parameters schema)]; `field` names a tool's schema in the
    request, with {} for its name."""
    return [(field.format(name), params) for name, params in tools]


class GrammarLanes:
    def __init__(self, metrics, budget_s: float = GRAMMAR_BUDGET_S):
        self.metrics, self.budget_s = metrics, budget_s
        self.lanes = {
            name: _Lane(name, ThreadPoolExecutor(threads, thread_name_prefix=f"grammar-{name}"), jobs)
            for name, (threads, jobs) in LANES.items()
        }

    async def build(self, fn: Callable[[Any], str], arg, schemas: list[tuple[str, Any]], what: str) -> str:
        """fn(arg) (a grammar) on the lane of the size of `schemas` [(field, schema)], the schemas it
        compiles. `what`: the field a 400 names when no one schema is to blame (json_object: none)."""
        sizes = schema_fields(schemas)
        lane = self.lanes["large" if sum(size for _, size in sizes) > SMALL_SCHEMA_BYTES else "small"]
        culprit = max(sizes, key=lambda s: s[1])[0] if sizes else what
        if not lane.admit():
            self.metrics.tokenize_refused.labels("busy").inc()
            raise GrammarBusy(f"{lane.max_jobs} grammars of {lane.name} schemas are waiting to be built; retry shortly")
        started: list[float] = []

        def job():
            started.append(time.monotonic())
            return fn(arg)

        future = lane.executor.submit(job)
        future.add_done_callback(lane.release)
        self.metrics.tokenizing.inc()
        t0 = time.perf_counter()
        result = asyncio.wrap_future(future)
        result.add_done_callback(_retrieved)  # one built after its request left or ran out of time: dropped
        try:
            return await self._within_budget(result, started, culprit)
        finally:
            future.cancel()  # not started yet (the request left, or is refused): it never runs
            self.metrics.tokenizing.dec()
            self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)

    async def _within_budget(self, result: asyncio.Future, started: list[float], culprit: str) -> str:
        """The grammar, once built; a 400 naming `culprit` if that takes over the budget from its start
        (time waiting for the lane's thread does not count)."""
        while True:
            left = self.budget_s if not started else self.budget_s - (time.monotonic() - started[0])
            if left <= 0:
                raise InvalidRequest(
                    f"{culprit}: the grammar engine did not compile this schema within "
                    f"{self.budget_s:g} s; simplify it (fewer properties, alternatives, formats or "
                    "patterns)",
                    param=culprit,
                )
            try:
                return await asyncio.wait_for(asyncio.shield(result), left)
            except asyncio.TimeoutError:
                continue


def _retrieved(result: asyncio.Future) -> None:
    if not result.cancelled():
        result.exception()
