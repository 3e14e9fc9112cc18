"""Incremental detokenization and stop strings, as a streaming client sees them."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

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
@given(st.text(alphabet="abc", max_size=30), st.lists(st.integers(1, 5), max_size=10), st.text(alphabet="abc", min_size=1, max_size=3))
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
