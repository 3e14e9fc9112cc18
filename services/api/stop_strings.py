"""Stop strings over streamed text: text that could be the start of a stop string is held back until
the next delta decides, so a client never sees part of a stop string.

Each stop string is matched by a Knuth-Morris-Pratt automaton carried across deltas, so the text costs
time in its own length (times the number of stop strings): testing every prefix of a stop string against
the text's end cost, for a delta that left a long matched prefix, time in that prefix's square (0.3 s for
100,000 characters). The api also caps a stop string at schema.MAX_STOP_CHARS."""

from __future__ import annotations

from functools import lru_cache


class _StopAutomaton:
    """One stop string's matcher: `matched` is the longest prefix of it that the text seen so far ends with."""

    def __init__(self, stop: str):
        self.stop = stop
        self.fallback = _prefix_function(stop)
        self.matched = 0

    def feed(self, text: str) -> int | None:
        """Advance over `text`; the index in it where the stop string first ends, or None."""
        stop, fallback, q = self.stop, self.fallback, self.matched
        for i, c in enumerate(text):
            while q and stop[q] != c:
                q = fallback[q - 1]
            if stop[q] == c:
                q += 1
                if q == len(stop):
                    self.matched = q
                    return i
        self.matched = q
        return None


@lru_cache(maxsize=256)
def _prefix_function(s: str) -> tuple[int, ...]:
    """pi[i]: the length of the longest proper prefix of s[: i + 1] that is also its suffix. Cached: a request's
    choices (n up to 64) and the next requests share their stop strings, built on the api's event loop."""
    pi = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = pi[k - 1]
        if s[i] == s[k]:
            k += 1
        pi[i] = k
    return tuple(pi)


class StopStringFilter:
    def __init__(self, stops: list[str]):
        self.stops = [_StopAutomaton(s) for s in stops if s]
        self.held = ""
        self.matched: str | None = None  # the stop string that ended the output, once one did

    def push(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit). After a hit the request is over; the
        stop string itself and anything after it are dropped. Of several hits the earliest-starting wins."""
        if not self.stops:
            return delta, False
        text = self.held + delta
        hits = []
        for automaton in self.stops:
            end = automaton.feed(delta)
            if end is not None:
                hits.append((len(self.held) + end + 1 - len(automaton.stop), automaton.stop))
        if hits:
            self.held = ""
            first, self.matched = min(hits, key=lambda hit: hit[0])
            return text[:first], True
        # held back: the longest end of the text that begins some stop string (no match reaches further back,
        # since the text held before was already the longest such end)
        keep = max(automaton.matched for automaton in self.stops)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
