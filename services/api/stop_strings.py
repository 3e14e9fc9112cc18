"""Stop strings over streamed text: text that could be the start of a stop string is held back until
the next delta decides, so a client never sees part of a stop string."""

from __future__ import annotations


class StopStringFilter:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.matched: str | None = None  # the stop string that ended the output, once one did

    def push(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit). After a hit the request is over; the
        stop string itself and anything after it are dropped."""
        if not self.stops:
            return delta, False
        text = self.held + delta
        hits = [(i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            first, self.matched = min(hits, key=lambda hit: hit[0])
            return text[:first], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
