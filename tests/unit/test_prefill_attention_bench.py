"""bench/prefill_attention.py's FLOP count, against counting the (query, key) pairs a causal chunk sees."""

from __future__ import annotations

import pytest

from bench.prefill_attention import causal_flops


@pytest.mark.parametrize("chunk,context", [(1, 0), (5, 0), (4, 7), (16, 100)])
def test_causal_flops_count_every_visible_key_of_every_new_token(chunk, context):
    pairs = sum(context + i + 1 for i in range(chunk))  # token i of the chunk sees context + i + 1 keys
    assert causal_flops(chunk, context, heads=3, head_dim=8) == 4 * 8 * 3 * pairs
