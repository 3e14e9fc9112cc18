"""Limits on a JSON body before it is decoded: nesting depth (docs/ARCHITECTURE.md §1, "Trust").

msgspec decodes recursively, ignored fields included, so a body nested a thousand deep fails with a
RecursionError; real requests (messages, tool schemas) nest a few dozen levels at most. The depth is
counted outside strings in a few vectorised passes of numpy over the bytes: linear in the body's size
whatever its shape, so it runs on the event loop without stalling other requests. (A regular
expression that skipped strings took quadratic time on an unterminated string of escaped quotes:
18 s for a few hundred KB.)"""

from __future__ import annotations

import numpy as np

from ferry.shared.errors import InvalidRequest

MAX_JSON_DEPTH = 64
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_DELTA = np.zeros(256, np.int8)
_DELTA[[ord("["), ord("{")]] = 1
_DELTA[[ord("]"), ord("}")]] = -1


def _inside_strings(data: np.ndarray) -> np.ndarray:
    """Whether each byte lies inside a string (its quotes count as inside or not: they are no brackets).
    A quote opens or closes a string unless it follows an odd run of backslashes. Outside a string a
    backslash is not JSON at all: the decoder stops there, before anything this could get wrong after
    it. Elementwise passes and scans, plus work per backslash run: linear whatever the mix."""
    flips = data == _QUOTE
    slashes = np.flatnonzero(data == _BACKSLASH)
    if slashes.size:
        first = np.flatnonzero(np.diff(slashes, prepend=-2) != 1)  # where each run starts, in `slashes`
        last = np.append(first[1:], slashes.size) - 1  # and where it ends
        after = slashes[last[(last - first) % 2 == 0]] + 1  # the byte after each odd run: escaped
        flips[after[after < data.size]] = False  # an escaped quote flips nothing
    return np.bitwise_xor.accumulate(flips.view(np.uint8)).view(bool)


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body` (0 for a scalar); brackets inside strings
    do not count. Linear time and memory in len(body)."""
    opens = body.count(b"[") + body.count(b"{")
    if opens <= MAX_JSON_DEPTH:
        return opens  # an upper bound, and under the limit: nothing to count
    data = np.frombuffer(body, np.uint8)
    delta = np.where(_inside_strings(data), np.int8(0), _DELTA[data])
    return int(np.cumsum(delta, dtype=np.int32).max())


def check_depth(body: bytes) -> None:
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise InvalidRequest(f"the request body nests {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
