"""Log-probabilities in OpenAI's shapes, from the worker's Logprobs (token ids and float32 values).

chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
               "refusal": null}
completions:  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}], "text_offset": [...]}

A token's string is its own decoded text; `bytes` are its exact bytes (a byte-level BPE token may hold
part of a UTF-8 character, whose string is then U+FFFD while its bytes are exact).
"""

from __future__ import annotations

import math
from functools import lru_cache

from ferry.shared.byte_level import unicode_to_bytes

_BYTE_OF = unicode_to_bytes()


class TokenText:
    """Token id -> (string, bytes), cached: the same few thousand tokens come up again and again."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.get = lru_cache(maxsize=65536)(self._compute)

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        raw = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(raw, str) and raw and all(c in _BYTE_OF for c in raw):
            data = bytes(_BYTE_OF[c] for c in raw)
            if data.decode("utf-8", errors="replace") == text or "\ufffd" in text:
                return text, list(data)
        return text, list(text.encode())


def _value(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf (a token a grammar or bias ruled out)


def chat_entries(text: TokenText, items: list[tuple[int, object]]) -> list[dict]:
    """[(token id, Logprobs of one position)] -> chat `logprobs.content` entries."""
    out = []
    for token_id, lp in items:
        s, b = text.get(token_id)
        tops = []
        for tid, v in zip(lp.top_ids[0].tolist(), lp.top_logprobs[0].tolist()):
            ts, tb = text.get(tid)
            tops.append({"token": ts, "logprob": _value(v), "bytes": tb})
        out.append({"token": s, "logprob": _value(lp.token_logprobs[0]), "bytes": b, "top_logprobs": tops})
    return out


class CompletionLogprobs:
    """The legacy completions object, built up token by token (prompt tokens first, with echo)."""

    def __init__(self, text: TokenText, offset: int = 0):
        self.text = text
        self.offset = offset  # characters before the first token (text_offset)
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        s, _ = self.text.get(token_id)
        self.tokens.append(s)
        self.token_logprobs.append(None if logprob is None else _value(logprob))
        self.top_logprobs.append(None if top is None else self._top(top))
        self.text_offset.append(self.offset)
        self.offset += len(s)

    def _top(self, top: list[tuple[int, float]]) -> dict:
        """{token string: logprob}; tokens whose strings coincide (parts of one character) keep the first."""
        out: dict[str, float] = {}
        for t, v in top:
            out.setdefault(self.text.get(t)[0], _value(v))
        return out

    def add_position(self, token_id: int, lp, row: int = 0) -> None:
        """A token with the row of a Logprobs that describes it."""
        top = list(zip(lp.top_ids[row].tolist(), lp.top_logprobs[row].tolist()))
        self.add(token_id, float(lp.token_logprobs[row]), top)

    def to_json(self, since: int = 0) -> dict:
        return {
            "tokens": self.tokens[since:],
            "token_logprobs": self.token_logprobs[since:],
            "top_logprobs": self.top_logprobs[since:],
            "text_offset": self.text_offset[since:],
        }

    def __len__(self) -> int:
        return len(self.tokens)


def prompt_positions(prompt: list[int], chunks: list) -> dict[int, tuple[object, int]]:
    """{position: (Logprobs, row)} of the prompt positions the worker scored (position 0 never is)."""
    out = {}
    for lp in chunks:
        for row in range(len(lp.token_logprobs)):
            out[lp.start + row] = (lp, row)
    return out
