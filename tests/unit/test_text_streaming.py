"""Incremental detokenization and stop strings, as a streaming client sees them."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.services.api.detokenizer import REPLACEMENT, IncrementalDetokenizer
from ferry.services.api.stop_strings import StopStringFilter


def stream(tok, ids):
    d = IncrementalDetokenizer(tok)
    deltas = [d.push(i) for i in ids]
    deltas.append(d.flush())
    return deltas


def test_multibyte_characters_split_across_tokens_are_never_emitted_half_done(tiny_tokenizer):
    text = "héllo wörld — 你好, emoji 🚢 ferry 🦀 ж ق"  # the last three are not in the training text
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(tiny_tokenizer.encode(text[:-7], add_special_tokens=False)) + 4  # 🦀 ж ق span bytes
    deltas = stream(tiny_tokenizer, ids)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab cé你🚢\n")), min_size=1, max_size=40))
def test_concatenated_deltas_equal_the_full_decode(tiny_tokenizer, text):
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(tiny_tokenizer, ids)
    assert "".join(deltas) == tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(REPLACEMENT in d for d in deltas)


def test_special_tokens_produce_no_text(tiny_tokenizer):
    ids = tiny_tokenizer.encode("hi", add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
    assert "".join(stream(tiny_tokenizer, ids)) == "hi"


def run_filter(stops, deltas):
    f = StopStringFilter(stops)
    out = []
    for d in deltas:
        emit, hit = f.push(d)
        out.append(emit)
        if hit:
            return out, True
    out.append(f.flush())
    return out, False


def test_stop_string_split_across_deltas_is_never_shown():
    out, hit = run_filter(["STOP"], ["hello S", "TO", "P and more"])
    assert hit and "".join(out) == "hello "
    assert all("S" not in d for d in out)


def test_partial_match_that_does_not_complete_is_released():
    out, hit = run_filter(["STOP"], ["a ST", "ONE b"])
    assert not hit and "".join(out) == "a STONE b"
    assert out[0] == "a "


def test_earliest_of_several_stop_strings_wins():
    out, hit = run_filter(["world", "lo w"], ["hello world"])
    assert hit and "".join(out) == "hel"


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="abc", max_size=30),
    st.lists(st.integers(1, 5), max_size=10),
    st.text(alphabet="abc", min_size=1, max_size=3),
)
def test_filter_output_is_the_text_up_to_the_first_stop(text, cuts, stop):
    pieces, rest = [], text
    for c in cuts:
        pieces.append(rest[:c])
        rest = rest[c:]
    pieces.append(rest)
    out, hit = run_filter([stop], pieces)
    idx = text.find(stop)
    assert hit == (idx >= 0)
    assert "".join(out) == (text[:idx] if idx >= 0 else text)


class _CountingTokenizer:
    """The tokenizer, counting the decode calls and the token ids they were given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls, self.ids = tokenizer, 0, 0

    def decode(self, ids, **kwargs):
        self.calls += 1
        self.ids += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def _byte_token(tokenizer, byte: int) -> int:
    """The id of the token of one byte (byte-level BPE writes byte b as a printable character: GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char = chr(byte) if byte in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(byte))
    return tokenizer.convert_tokens_to_ids(char)


def test_lone_continuation_bytes_cost_linear_decoding_and_go_out_as_replacements_within_the_bound(tiny_tokenizer):
    """8,000 tokens of a byte that never forms UTF-8 (what a logit_bias pinning it writes): each token decodes a
    window of at most MAX_WINDOW_TOKENS tokens, not the output so far, and each byte goes out as U+FFFD at most
    PENDING_CHARS tokens later."""
    from ferry.services.api.detokenizer import MAX_WINDOW_TOKENS, PENDING_CHARS

    counting = _CountingTokenizer(tiny_tokenizer)
    d = IncrementalDetokenizer(counting)
    lone = _byte_token(tiny_tokenizer, 0x80)
    out = ""
    for i in range(1, 8001):
        out += d.push(lone)
        assert out == REPLACEMENT * len(out) and len(out) >= i - PENDING_CHARS, (i, len(out))
    assert out + d.flush() == REPLACEMENT * 8000
    assert counting.calls <= 2 * 8001 and counting.ids <= 2 * (MAX_WINDOW_TOKENS + 1) * 8001, (
        counting.calls,
        counting.ids,
    )


def test_characters_split_across_byte_tokens_and_invalid_bytes_between_them_come_out_as_a_full_decode(tiny_tokenizer):
    """Characters of one byte token each, windows restarting in the middle of them, invalid bytes before one."""
    lone = _byte_token(tiny_tokenizer, 0x80)
    text = "你好世界 🚢⚓ é" * 20
    ids = [lone] * 6 + [_byte_token(tiny_tokenizer, b) for b in text.encode()] + [lone, lone]
    deltas = stream(tiny_tokenizer, ids)
    assert "".join(deltas) == REPLACEMENT * 6 + text + REPLACEMENT * 2
    assert REPLACEMENT not in "".join(deltas[12:-3])  # the invalid bytes go out by the first character


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 399), max_size=80))
def test_any_tokens_stream_as_their_full_decode(tiny_tokenizer, ids):
    """Whatever the tokens (invalid bytes, special tokens, characters split anywhere), the deltas add up to
    the decode of them all."""
    assert "".join(stream(tiny_tokenizer, ids)) == tiny_tokenizer.decode(ids, skip_special_tokens=True)


def _reference_filter_output(stops, pieces):
    """The filter's rule, plainly and slowly: at the first delta after which the text holds a stop string, the
    text up to the earliest-starting one there; else all of it."""
    text = ""
    for p in pieces:
        text += p
        hits = [(i, s) for s in stops if s for i in [text.find(s)] if i >= 0]
        if hits:
            return text[: min(hits)[0]], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="ab", max_size=40),
    st.lists(st.integers(1, 6), max_size=12),
    st.lists(st.text(alphabet="ab", min_size=1, max_size=6), min_size=1, max_size=4),
)
def test_several_stop_strings_stop_at_the_earliest_and_hold_back_only_what_may_begin_one(text, cuts, stops):
    pieces, rest = [], text
    for c in cuts:
        pieces.append(rest[:c])
        rest = rest[c:]
    pieces.append(rest)
    out, hit = run_filter(stops, pieces)
    assert ("".join(out), hit) == _reference_filter_output(stops, pieces)
    if not hit:  # what a delta held back is exactly the longest end that begins a stop string
        f, seen = StopStringFilter(stops), ""
        for p in pieces:
            emitted, _ = f.push(p)
            seen += p
            assert any(s.startswith(f.held) for s in stops) or not f.held
            longest = max((k for s in stops for k in range(1, len(s)) if seen.endswith(s[:k])), default=0)
            assert len(f.held) == longest


def test_a_stop_string_longer_than_the_cap_is_refused_naming_the_field():
    """The matcher is built on the api's event loop, per request: a stop string is at most MAX_STOP_CHARS long."""
    import pytest

    from ferry.services.api import anthropic_schema, schema
    from ferry.shared.errors import InvalidRequest

    long = "x" * (schema.MAX_STOP_CHARS + 1)
    for body in ({"model": "m", "prompt": "hi", "stop": long}, {"model": "m", "prompt": "hi", "stop": ["ok", long]}):
        req = schema.decode_body(json.dumps(body).encode(), schema.CompletionRequest)
        with pytest.raises(InvalidRequest) as err:
            schema.validate_generation(req, req.max_tokens)
        assert err.value.param == "stop" and str(schema.MAX_STOP_CHARS) in str(err.value)
    fits = schema.decode_body(
        json.dumps({"model": "m", "prompt": "hi", "stop": long[1:]}).encode(), schema.CompletionRequest
    )
    schema.validate_generation(fits, fits.max_tokens)
    req = schema.decode_body(
        json.dumps(
            {"model": "m", "max_tokens": 5, "stop_sequences": [long], "messages": [{"role": "user", "content": "hi"}]}
        ).encode(),
        anthropic_schema.MessagesRequest,
    )
    with pytest.raises(InvalidRequest, match="stop_sequences"):
        anthropic_schema.validate(req)
