"""The api's segment cache (services/api/segment_cache.py): a prompt tokenized segment by segment between
special tokens, the segments sent before looked up, gives exactly the ids the tokenizer gives the whole
prompt, for the tiny test tokenizer and the bench models' byte-level one, first time and cached."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.services.api.segment_cache import SegmentCache

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


@pytest.fixture(scope="module")
def tokenizers(tiny_tokenizer):
    from ferry.services.tiny_model.tokenizer import printable_tokenizer

    return {"tiny": tiny_tokenizer, "bench": printable_tokenizer(5000)}


pieces = st.lists(
    st.one_of(
        st.sampled_from(SPECIALS),
        st.text(max_size=40),
        st.sampled_from([" ", "\n", "\n\n", "  x", "é", "你好", "🚢", "<|im", "_end|>"]),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(parts=pieces)
def test_segment_by_segment_equals_the_whole_prompt_first_time_and_cached(tokenizers, parts):
    text = "".join(parts)
    for hf in tokenizers.values():
        cache = SegmentCache.for_tokenizer(hf)
        assert cache is not None
        want = hf.encode(text, add_special_tokens=False)
        assert cache.encode(text, hf) == want
        assert cache.encode(text, hf) == want  # every segment from the cache now


def test_a_next_turn_tokenizes_only_its_new_segments(tokenizers):
    hf = tokenizers["tiny"]
    cache = SegmentCache.for_tokenizer(hf)
    turn1 = (
        "<|im_start|>system\nYou read logs.<|im_end|>\n<|im_start|>user\n"
        + "ferry " * 2000
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    turn2 = turn1 + "It is about ferries.<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
    assert cache.encode(turn1, hf) == hf.encode(turn1, add_special_tokens=False)
    before = cache.misses
    assert cache.encode(turn2, hf) == hf.encode(turn2, add_special_tokens=False)
    # the new answer and question, and the assistant's opening written after them (already seen: no miss)
    assert cache.misses - before == 2


def test_the_cache_stays_within_its_characters_and_stays_exact(tokenizers):
    hf = tokenizers["bench"]
    cache = SegmentCache.for_tokenizer(hf, max_chars=100)
    texts = [f"<|im_start|>user\nmessage {i} " + "x" * 30 + "<|im_end|>" for i in range(20)]
    for t in texts + texts:
        assert cache.encode(t, hf) == hf.encode(t, add_special_tokens=False)
    assert cache._chars <= 100


def test_a_tokenizer_whose_special_tokens_strip_spaces_is_not_cut(tokenizers):
    """A special token that swallows the spaces beside it (rstrip/lstrip) cuts the text differently than a
    literal split would: such tokens never cut, and with none left there is no cache."""
    import copy

    from tokenizers import AddedToken

    stripping = copy.deepcopy(tokenizers["tiny"])
    stripping.add_special_tokens(
        {"additional_special_tokens": [AddedToken("<|tool|>", lstrip=True, rstrip=True, special=True)]}
    )
    cache = SegmentCache.for_tokenizer(stripping)
    assert cache is not None and "<|tool|>" not in cache.specials
    text = "a  <|tool|>  b " * 3
    assert cache.encode(text, stripping) == stripping.encode(text, add_special_tokens=False)


def test_the_prompt_tokenizer_uses_it_for_long_prompts_and_its_copies_share_it(tiny_tokenizer_dir):
    from ferry.services.api.segment_cache import MIN_PROMPT_CHARS
    from ferry.services.api.tokenizer import PromptTokenizer

    tok = PromptTokenizer(str(tiny_tokenizer_dir))
    long = "<|im_start|>user\n" + "hello world " * (MIN_PROMPT_CHARS // 10) + "<|im_end|>"
    assert tok.encode(long) == tok.hf.encode(long, add_special_tokens=False) and tok.segments.misses == 1
    twin = tok.copy()
    assert twin.encode(long) == tok.hf.encode(long, add_special_tokens=False)
    assert twin.segments is tok.segments and tok.segments.hits == 1  # one cache, each thread's own tokenizer
    tok.encode("short <|im_end|>")  # below MIN_PROMPT_CHARS: tokenized whole
    assert tok.segments.misses == 1


def test_metrics_count_the_segments_found_and_tokenized(tokenizers):
    from prometheus_client import generate_latest

    from ferry.services.api.metrics import ApiMetrics

    hf = tokenizers["tiny"]
    cache = SegmentCache.for_tokenizer(hf)
    metrics = ApiMetrics()
    metrics.watch_segment_cache(cache)
    turn = "<|im_start|>user\n" + "hello world " * 50 + "<|im_end|>\n<|im_start|>assistant\n"
    cache.encode(turn, hf)
    cache.encode(turn + "hi<|im_end|>", hf)
    text = generate_latest(metrics.registry).decode()
    # turn 1: the question, the newline between the messages, the assistant's opening; turn 2: the opening with "hi"
    assert "ferry_prompt_segments_tokenized_total 4.0" in text
    assert "ferry_prompt_segments_cached_total 2.0" in text
    ApiMetrics().watch_segment_cache(None)  # a tokenizer without a cache: nothing to export, no error
