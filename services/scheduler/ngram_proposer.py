"""Prompt-lookup drafting (speculative decoding's weight-free source): the request's own tokens, prompt and
output, searched for an earlier occurrence of their last n tokens, n from NGRAM_MAX down to NGRAM_MIN; the
tokens that followed the most recent such occurrence are the drafts. Text that repeats itself (code, a quoted
document, a JSON key list) continues as it did before. No torch: the scheduler drafts (shared/speculation.py)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ferry.shared.speculation import NGRAM_MAX, NGRAM_MIN


def propose_ngram(tokens: list[int] | np.ndarray, k: int, n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX) -> list[int]:
    """Up to k draft tokens after `tokens`: those following the most recent earlier occurrence of the longest
    suffix of n_min..n_max tokens that occurs earlier; [] when none does (or k < 1). The longest suffix, since
    a longer match predicts its continuation better; the most recent occurrence, since text repeats what it
    said last (a loop's latest turn)."""
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    if k < 1:
        return []
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = seq[total - n :]
        # windows starting at 0..total-n-1: every occurrence that ends before the suffix's own last token
        windows = sliding_window_view(seq[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the match
            return seq[start : start + k].tolist()
    return []
