"""Token ids of a prompt's segments between special tokens, kept across requests (the api's tokenizer).

An agent resends its whole conversation every turn, and the api tokenized all of it every time: ~30 ms
for a 32k-token conversation on this project's 2-core machine (105 ms for 114k tokens), on the way to a
first token that the hybrid prefix cache otherwise brings to ~0.4 s. A chat template writes every
message between special tokens (`<|im_start|>` ... `<|im_end|>`), and a fast tokenizer cuts its input
at added tokens before it normalises or pre-tokenises anything: the text on either side of a special
token is tokenized on its own. So a prompt is its segments between special tokens, each tokenized
alone, and the segments a conversation sent before (every message but the new ones) are looked up here
instead of tokenized again; the new ones are tokenized in one batch call. A chat prompt in which a
client's text spells a special token is cut by its caller at the template's special tokens alone
(PromptTokenizer.encode_chat): `encode_segments` takes the texts between them that spell none.

Only special tokens the tokenizer matches literally cut a prompt (not normalised, no stripping of the
spaces beside them, not whole-word only): with those flags the cut is exactly where the tokenizer cuts.
`SegmentCache.for_tokenizer` checks that on a sample before the cache is used, and returns None (the
whole prompt is tokenized as before) for a tokenizer where it does not hold. Bounded by characters,
least recently used first out; one cache is shared by the api's tokenizer threads (a lock guards it).
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

# Prompts shorter than this are tokenized whole: the lookups would cost about what they save.
MIN_PROMPT_CHARS = 4096
DEFAULT_MAX_CHARS = 16 * 2**20  # 16 M characters of segments (a hundred 32k-token conversations), ~4 M ids: 16 MB
_SAMPLE_TEXT = (
    "You are a helpful assistant.\n\nHello there, général Kenobi! 1234567890 + - * / = ?\n"
    "  indented  lines\tand\ttabs \n\n 你好世界 🚢⚓ trailing space "
)


class SegmentCache:
    """Token ids of segments, keyed by their text, for one tokenizer's `specials` {token: id}; `encode`
    takes the tokenizer to use (each api thread has its own copy of it)."""

    def __init__(self, specials: dict[str, int], max_chars: int = DEFAULT_MAX_CHARS):
        self.specials, self.max_chars = specials, max_chars
        self._cut = re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
        self._ids: OrderedDict[str, array] = OrderedDict()  # int32 ids: a Python int list would take 9x the memory
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0  # segments found here, segments tokenized

    @classmethod
    def for_tokenizer(cls, hf: Any, max_chars: int = DEFAULT_MAX_CHARS) -> SegmentCache | None:
        """A cache for this tokenizer, or None where its special tokens cannot cut a prompt exactly."""
        specials = {}
        for token_id, added in getattr(hf, "added_tokens_decoder", {}).items():
            literal = not (added.normalized or added.lstrip or added.rstrip or added.single_word)
            if added.special and literal and added.content:
                specials[added.content] = token_id
        if not specials:
            return None
        cache = cls(specials, max_chars)
        joined = "".join(f"{t}{_SAMPLE_TEXT}" for t in list(specials)[:8]) + _SAMPLE_TEXT
        sample = _SAMPLE_TEXT + joined + joined
        if cache.encode(sample, hf) != hf.encode(sample, add_special_tokens=False):
            return None
        cache.clear()
        return cache

    def encode(self, text: str, hf: Any) -> list[int]:
        """The ids tokenizer `hf` gives `text` (add_special_tokens=False), segment by segment."""
        parts = self._cut.split(text)
        out: list[int] = []
        for i, ids in enumerate(self.encode_segments(parts[0::2], hf)):
            out.extend(ids)
            if 2 * i + 1 < len(parts):
                out.append(self.specials[parts[2 * i + 1]])
        return out

    def encode_segments(self, segments: list[str], hf: Any) -> list[array]:
        """The ids tokenizer `hf` gives each of `segments` alone (texts between special tokens), those
        seen before looked up, the new ones tokenized in one batch call."""
        with self._lock:
            known = [self._ids.get(s) if s else array("i") for s in segments]
            for s, ids in zip(segments, known):
                if s and ids is not None:
                    self._ids.move_to_end(s)
        new = sorted({s for s, ids in zip(segments, known) if ids is None})
        if new:
            encoded = {s: array("i", ids) for s, ids in zip(new, encode_each(hf, new))}
            with self._lock:
                for s, ids in encoded.items():
                    self._put(s, ids)
            known = [encoded[s] if ids is None else ids for s, ids in zip(segments, known)]
        fresh = set(new)
        with self._lock:
            self.hits += sum(1 for s in segments if s and s not in fresh)
            self.misses += len(new)
        return known

    def _put(self, segment: str, ids: array) -> None:
        if segment in self._ids or len(segment) > self.max_chars:
            return
        self._ids[segment] = ids
        self._chars += len(segment)
        while self._chars > self.max_chars:
            old, _ = self._ids.popitem(last=False)
            self._chars -= len(old)

    def clear(self) -> None:
        with self._lock:
            self._ids.clear()
            self._chars = 0
            self.hits = self.misses = 0


def encode_each(hf: Any, texts: list[str], as_text: bool = False) -> list[list[int]]:
    """The tokenizer's ids of each text alone: its Rust backend's batch call where it has one (what
    `encode` calls, without building a BatchEncoding), else the tokenizer's own batch call. `as_text`:
    a special token spelled in a text is read as text (a client's text in a chat prompt)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return hf(texts, add_special_tokens=False, split_special_tokens=as_text)["input_ids"]
    reading = backend.encode_special_tokens
    backend.encode_special_tokens = as_text  # the thread's own tokenizer: no other call sees the setting
    try:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    finally:
        backend.encode_special_tokens = reading
