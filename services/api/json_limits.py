"""Limits on a JSON body before it is decoded: nesting depth (docs/ARCHITECTURE.md §1, "Trust").

msgspec decodes recursively, ignored fields included, so a body nested a thousand deep fails with a
RecursionError; real requests (messages, tool schemas) nest a few dozen levels at most. The depth is
counted outside strings, at C speed (one regular expression removes the strings, numpy counts)."""

from __future__ import annotations

import re

import numpy as np

from ferry.shared.errors import InvalidRequest

MAX_JSON_DEPTH = 64
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_DELTA = np.zeros(256, np.int8)
_DELTA[[ord("["), ord("{")]] = 1
_DELTA[[ord("]"), ord("}")]] = -1


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body` (0 for a scalar)."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return body.count(b"[") + body.count(b"{")  # an upper bound, and under the limit: nothing to count
    bare = np.frombuffer(_STRING.sub(b'""', body), np.uint8)
    depth = np.cumsum(_DELTA[bare], dtype=np.int64)
    return int(depth.max()) if depth.size else 0


def check_depth(body: bytes) -> None:
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise InvalidRequest(f"the request body nests {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
