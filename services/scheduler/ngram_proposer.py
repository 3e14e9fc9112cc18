"""Prompt-lookup drafting (speculative decoding's weight-free source): the request's own tokens, prompt and
output, searched for an earlier occurrence of their last n tokens, n from NGRAM_MAX down to NGRAM_MIN; the
tokens that followed the most recent such occurrence are the drafts. Text that repeats itself (code, a quoted
document, a JSON key list) continues as it did before. No torch: the scheduler drafts (shared/speculation.py).

The search runs every step for every decoding request over its whole sequence, so it is numpy over a copy of
the sequence that grows with it (`TokenArray`: no list converted each step) and compares the n-gram only where
its first token occurs."""

from __future__ import annotations

import numpy as np

from ferry.shared.speculation import NGRAM_MAX, NGRAM_MIN


class TokenArray:
    """A request's tokens as an int64 array, extended with the ones appended to its list since the last call
    (a request's tokens only grow)."""

    def __init__(self) -> None:
        self._buf = np.zeros(0, dtype=np.int64)
        self._len = 0

    def of(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if n < self._len:  # never expected (tokens only grow): start over rather than serve a stale copy
            self._len = 0
        if n > len(self._buf):
            grown = np.zeros(max(n, 2 * len(self._buf), 64), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        if n > self._len:
            self._buf[self._len : n] = tokens[self._len : n]
            self._len = n
        return self._buf[:n]


def propose_ngram(tokens, k: int, n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX) -> list[int]:
    """Up to k draft tokens after `tokens` (a sequence or an int array): those following the most recent earlier
    occurrence of the longest suffix of n_min..n_max tokens that occurs earlier; [] when none does (or k < 1).
    The longest suffix, since a longer match predicts its continuation better; the most recent occurrence, since
    text repeats what it said last (a loop's latest turn)."""
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    if k < 1 or total < n_min + 1:
        return []
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = seq[total - n :]
        # where an occurrence may start: its first token matches, and it ends before the sequence's last token
        cand = np.flatnonzero(seq[: total - n] == suffix[0])
        ok = np.ones(len(cand), dtype=bool)
        for j in range(1, n):
            ok &= seq[cand + j] == suffix[j]
        hits = cand[ok]
        if hits.size:
            start = int(hits[-1]) + n  # the token after the match
            return seq[start : start + k].tolist()
    return []
