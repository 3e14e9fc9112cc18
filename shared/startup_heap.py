"""What a process built to start (its modules, the model's Python objects, the tokenizer) kept out of the garbage
collector's full collections from then on.

A full collection walks every object the collector tracks, on whichever thread allocated when it came due: the
worker's while it enqueues a step, the api's event loop. A booted worker of the tiny model tracks ~190k objects,
and one full collection took 79-131 ms on the 2-core machine; served, the worker ran three (88-119 ms) and the api
two (52-117 ms) in the seconds after their boot, and any that comes later lands on a request. Frozen, the startup
heap is never walked again: a full collection then takes what serving allocated since (~0 ms after boot). Those
objects live as long as the process anyway; the price is that a reference cycle among them that later turns into
garbage is never freed (CPython's gc.freeze)."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once (startup's own garbage goes first, or it would be kept for good), then freeze what is left."""
    gc.collect()
    gc.freeze()
