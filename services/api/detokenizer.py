"""Incremental detokenization: text deltas as tokens arrive, never splitting a UTF-8 character.

Tokens can end in the middle of a multi-byte character; decoding such a prefix ends in U+FFFD (one
for the incomplete character with byte-level BPE, one per byte with a byte-fallback vocabulary), which
later bytes may turn into the character. So a token emits what its window of tokens decodes to beyond
what was already emitted, except a last run of up to PENDING_CHARS U+FFFD, which waits: the
characters before it are final. Bytes that never form UTF-8 (a lone continuation byte, which
`logit_bias` can pin) go out as U+FFFD a few tokens later, as vLLM's and HF's streamers write them.

Each token decodes a window of at most MAX_WINDOW_TOKENS tokens, not the whole output: linear in the
output. Past WINDOW_TOKENS the window restarts CONTEXT_TOKENS back (which keeps tokenizers whose
decode depends on the previous token right, such as leading spaces) at the first token whose text
holds nothing pending: the new window's text is then all emitted, even where it starts in the tail
of a character. A window that reaches MAX_WINDOW_TOKENS without such a token (only invalid bytes
arrive) restarts anyway, keeping only its last character pending: a character still incomplete has
at most 3 of its 4 bytes, so with byte-level BPE it is that character and lies in the last 3 tokens.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
PENDING_CHARS = 3  # U+FFFD at the end that may still become a character (byte fallback: one per byte of it)
WINDOW_TOKENS = 8  # a window restarts past this many tokens, where nothing is pending
MAX_WINDOW_TOKENS = 16  # and past this many whatever is pending
CONTEXT_TOKENS = 3  # tokens a restarted window keeps


class IncrementalDetokenizer:
    """`keep`: the ids of special tokens that stay in the text (a chat format's markup, which its parsers read:
    Gemma 4's tool calls); every other special token is left out, as skip_special_tokens leaves them all out."""

    def __init__(self, tokenizer: Any, keep: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        special = frozenset(i for i, t in tokenizer.added_tokens_decoder.items() if t.special) if keep else None
        self.skip = special - keep if special is not None else None  # None: skip_special_tokens drops them all
        self.ids: list[int] = []
        self.window_start = 0  # the decode window: ids[window_start:]
        self.emitted = 0  # characters of the window's text already emitted

    def _decode(self, ids: list[int]) -> str:
        if self.skip is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        kept = [i for i in ids if i not in self.skip]
        return self.tokenizer.decode(kept, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        """The text this token makes final ('' while it only adds to a character still incomplete)."""
        self.ids.append(token_id)
        text = self._decode(self.ids[self.window_start :])
        size = len(self.ids) - self.window_start
        pending = min(len(text) - len(text.rstrip(REPLACEMENT)), PENDING_CHARS if size <= MAX_WINDOW_TOKENS else 1)
        final = len(text) - pending
        delta = text[self.emitted : final]
        self.emitted = max(self.emitted, final)
        if size > WINDOW_TOKENS and (pending == 0 or size > MAX_WINDOW_TOKENS):
            self.window_start = len(self.ids) - CONTEXT_TOKENS
            context = self._decode(self.ids[self.window_start :])
            if pending and not context.endswith(REPLACEMENT):
                delta += text[final:]  # the pending character lies before the context (tokens without text)
                pending = 0
            self.emitted = len(context) - pending
        return delta

    def flush(self) -> str:
        """At the end of the output: whatever is still held back (an incomplete character stays U+FFFD)."""
        text = self._decode(self.ids[self.window_start :])
        delta = text[self.emitted :]
        self.window_start, self.emitted = len(self.ids), 0
        return delta
