"""Gemma 4's output markup (services/api/gemma4_format.py): its tool calls and reasoning read from text streamed
in every way it can be cut, its arguments typed by the tool's schema, and the grammar of a forced call run by
llguidance over a tokenizer with Gemma 4's markup as special tokens and over one without (the markup as text)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry.services.api import gemma4_format
from ferry.services.api.gemma4_format import parse_arguments, parse_call
from ferry.services.api.output_parsers import OutputParser
from ferry.shared.errors import InvalidRequest
from tests.unit.test_output_parsers import merged

S = '<|"|>'  # Gemma 4's string delimiter
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
        "zip": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["city"],
}
TOOLS = {"get_weather": WEATHER}


def call(args: str, name: str = "get_weather") -> str:
    return f"<|tool_call>call:{name}{{{args}}}<tool_call|>"


def parse(text: str, cuts, **kw) -> list:
    parser = OutputParser(kw.pop("reasoning", "gemma4"), kw.pop("tool_calls", "gemma4"), kw.pop("tools", TOOLS), **kw)
    events, last = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.push(text[last:cut])
        last = cut
    return merged(events + parser.flush())


def every_split(text: str, **kw) -> list:
    """The whole text at once, then every cut into two and into single characters: all agree."""
    whole = parse(text, [], **dict(kw))
    for i in range(1, len(text)):
        assert parse(text, [i], **dict(kw)) == whole, f"cut at {i}: {text[:i]!r} | {text[i:]!r}"
    assert parse(text, range(1, len(text)), **dict(kw)) == whole
    return whole


def test_text_then_two_calls_back_to_back():
    text = f"Let me look.\n{call(f'city:{S}Paris{S},days:3')}{call(f'city:{S}Oslo{S}')}"
    assert every_split(text) == [
        ("Text", "Let me look."),
        ("call", "get_weather", {"city": "Paris", "days": 3}),
        ("call", "get_weather", {"city": "Oslo"}),
    ]


def test_thought_channel_is_reasoning_then_the_answer_and_a_call():
    text = f"<|channel>thought\nThe user wants Rome.\n<channel|>Checking.{call(f'city:{S}Rome{S}')}"
    assert every_split(text) == [
        ("Reasoning", "The user wants Rome."),
        ("Text", "Checking."),
        ("call", "get_weather", {"city": "Rome"}),
    ]
    # the template's closed empty channel ends the prompt when thinking is off: the output is all answer
    assert every_split("It is sunny.", tools=None) == [("Text", "It is sunny.")]
    # cut off inside the thought (max_tokens): all of it is reasoning
    assert every_split("<|channel>thought\nStill going", tools=None) == [("Reasoning", "Still going")]


def test_strings_hold_markup_characters_and_arguments_are_typed_by_the_schema():
    weird = 'a, "b": {c} [d]\nline: e'
    text = call(f"city:{S}{weird}{S},days:{S}4{S},tags:[{S}x{S},{S}y, z{S}],zip:02134")
    assert every_split(text) == [
        ("call", "get_weather", {"city": weird, "days": 4, "tags": ["x", "y, z"], "zip": "02134"})
    ]
    nested = 'cfg:{deep:{on:true,off:false,none:null},list:[1,2.5,-3e2,{k:<|"|>v<|"|>}]},n:7'
    assert parse_arguments("{" + nested + "}") == {
        "cfg": {"deep": {"on": True, "off": False, "none": None}, "list": [1, 2.5, -300.0, {"k": "v"}]},
        "n": 7,
    }
    # without a schema a value is typed as written, a bare word (or no JSON number) as its text; delimited keys
    assert parse_arguments(f"{{n:2134,zip:02134,city:Paris,{S}key{S}:{S}1{S}}}") == {
        "n": 2134,
        "zip": "02134",
        "city": "Paris",
        "key": "1",
    }
    # a string where the schema wants a number stays a string when it spells none
    assert parse_call(f"call:get_weather{{days:{S}soon{S}}}", TOOLS).arguments == {"days": "soon"}


def test_malformed_calls_stay_text_and_cut_off_ones_are_dropped():
    for bad in (
        call("cfg:{a:1"),  # an object never closed
        call("city:Par{is"),  # a bare value holding structure
        call(f"city:{S}Paris"),  # a string never closed
        call(f"city:{S}Paris{S} days:3"),  # no comma between pairs
        "<|tool_call>get_weather{}<tool_call|>",  # no call: prefix
        "<|tool_call>call:get_weather<tool_call|>",  # no arguments
        call(f"city:{S}Paris{S}}}"),  # text after the arguments
    ):
        assert every_split(bad) == [("Text", bad)], bad
    # cut off (max_tokens, a stop string) inside a call: no call, and its raw markup is no answer either
    assert every_split(f"Sunny.\n<|tool_call>call:get_weather{{city:{S}Par") == [("Text", "Sunny.")]
    # complete arguments, the closing token not reached: a call
    assert every_split(f"<|tool_call>call:get_weather{{city:{S}Paris{S}}}") == [
        ("call", "get_weather", {"city": "Paris"})
    ]
    # no tools offered: no parsing
    assert every_split(call(f"city:{S}Rome{S}"), tools=None) == [("Text", call(f"city:{S}Rome{S}"))]


@pytest.mark.parametrize("tail", ["", "<|tool", f"<|tool_call>call:get_weather{{city:{S}Pa"])
def test_a_forced_output_is_only_its_calls_whatever_the_cut(tail):
    one = call(f"city:{S}Rome{S}")
    assert every_split(one + one + tail, forced=True) == [("call", "get_weather", {"city": "Rome"})] * 2


# ---- the grammar of a forced call ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["special", "text"])
def spelled(request, tiny_tokenizer_dir, tmp_path_factory):
    """(hf tokenizer, spell, allowed_after(grammar, text) -> allowed next tokens, or None where `text` breaks it):
    Gemma 4's markup as special tokens of the vocabulary, or (the test tokenizer as it is) as text."""
    import llguidance
    from transformers import AutoTokenizer

    from ferry.services.worker.grammar import tokenizer_factory

    directory = Path(tiny_tokenizer_dir)
    if request.param == "special":
        hf = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
        hf.add_special_tokens({"additional_special_tokens": list(gemma4_format.MARKUP_TOKENS)})
        directory = tmp_path_factory.mktemp("gemma4-markup")
        hf.save_pretrained(directory)
    hf = AutoTokenizer.from_pretrained(directory)
    ids = {t.content: i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert (S in ids) == (request.param == "special")

    def spell(markup: str) -> str:
        return f"<[{ids[markup]}]>" if markup in ids else json.dumps(markup)

    eos = hf.convert_tokens_to_ids("<|im_end|>")
    llg = tokenizer_factory(directory, len(hf), [eos])()

    def allowed_after(grammar: str, text: str) -> set[str] | None:
        m = llguidance.LLMatcher(llg, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if not m.consume_tokens(hf.encode(text, add_special_tokens=False)) or m.is_error():
            return None
        bias = m.compute_logit_bias()
        return {"end" if i == eos else hf.decode([i]) for i in range(len(hf)) if bias[i]}

    return hf, spell, allowed_after


def grammar(spell, tools=(("get_weather", WEATHER),), parallel=True) -> str:
    return gemma4_format.call_grammar(list(tools), parallel, 4, "tools[{}].function.parameters", spell)


def test_the_grammar_writes_calls_the_parser_reads_and_ends_after_them(spelled):
    _, spell, allowed_after = spelled
    one = call(f"city:{S}Paris, {{FR}}{S},days:3,tags:[{S}a{S}],unit:{S}f{S}")
    assert parse_call(one[len("<|tool_call>") : -len("<tool_call|>")], TOOLS).arguments == {
        "city": "Paris, {FR}",
        "days": 3,
        "tags": ["a"],
        "unit": "f",
    }
    g = grammar(spell)
    assert "end" in allowed_after(g, one) and "end" in allowed_after(g, one + call(f"city:{S}Oslo{S}"))
    assert allowed_after(g, one * 4) == {"end"}  # at most MAX_CALLS
    assert allowed_after(grammar(spell, parallel=False), one) == {"end"}
    assert "end" not in allowed_after(g, one[: -len("<tool_call|>")])
    assert allowed_after(g, f"<|tool_call>call:get_weather{{city:{S}Pa") is not None  # a string goes on


def test_the_grammar_holds_the_arguments_to_the_schema(spelled):
    _, spell, allowed_after = spelled
    g = grammar(spell)
    head = "<|tool_call>call:get_weather{"
    assert allowed_after(g, head + "days:3") is None  # `city` is required, and comes first (keys sorted)
    assert allowed_after(g, head + f"city:{S}x{S},days:9") is None  # maximum 7
    assert allowed_after(g, head + f"city:{S}x{S},unit:{S}k") is None  # not in the enum
    assert allowed_after(g, head + f"city:{S}x{S},tags:[{S}a{S},{S}b{S},{S}c{S},") is None  # maxItems 3
    assert allowed_after(g, head + f"city:{S}x{S},other:1") is None  # an undeclared key
    assert allowed_after(g, head + f"city:{S}x{S}y") is None  # a string ends at its first closing delimiter
    assert allowed_after(g, "<|tool_call>call:get_time{") is None  # not a forced tool
    code = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 2}}}
    g = grammar(spell, tools=[("f", code)], parallel=False)
    assert allowed_after(g, f"<|tool_call>call:f{{code:{S}FR{S}}}<tool_call|>") == {"end"}
    assert allowed_after(g, f"<|tool_call>call:f{{code:{S}Fr") is None  # the pattern
    assert allowed_after(g, f"<|tool_call>call:f{{code:{S}FRA") is None  # and the length, both


def test_a_schema_the_grammar_cannot_hold_to_is_a_400_naming_the_tool():
    for schema, what in (
        ({"type": "object", "properties": {"s": {"type": "string", "format": "date"}}}, "format"),
        ({"type": "object", "properties": {"s": {"type": "string", "pattern": "a+"}}}, "pattern"),
        ({"type": "object", "patternProperties": {"x": {}}}, "patternProperties"),
        ({"type": "object", "properties": {"s": {"type": "array", "maxItems": "two"}}}, ""),
    ):
        with pytest.raises(InvalidRequest, match=r"tools\[f\]\.function\.parameters.*" + what) as info:
            grammar(json.dumps, tools=[("f", schema)])
        assert info.value.param == "tools[f].function.parameters"


# ---- the api's choice of parsers, and the detokenized text they read ------------------------------------------------


@pytest.fixture(scope="module")
def gemma_tokenizer_dir(tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """The test tokenizer with Gemma 4's markup and turn end as special tokens, beside a gemma4 config.json."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    hf.add_special_tokens({"additional_special_tokens": [*gemma4_format.MARKUP_TOKENS, "<turn|>"]})
    directory = tmp_path_factory.mktemp("gemma4-tokenizer")
    hf.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "gemma4_text"}))
    return directory


def test_auto_parsers_are_the_model_familys_and_a_flag_overrides_them(gemma_tokenizer_dir, tiny_tokenizer_dir):
    from ferry.services.api.tokenizer import PromptTokenizer

    gemma = PromptTokenizer(str(gemma_tokenizer_dir))
    assert gemma.parsers == {"tool_calls": "gemma4", "reasoning": "gemma4"}
    assert PromptTokenizer(str(tiny_tokenizer_dir)).parsers == {"tool_calls": "qwen", "reasoning": "qwen3"}
    assert PromptTokenizer(str(gemma_tokenizer_dir), "auto", "qwen", "none").parsers == {
        "tool_calls": "qwen",
        "reasoning": "none",
    }
    # a forced call is written in the model's markup, its special tokens as tokens (also under --tool-call-parser
    # none: the grammar's markup is the parser's that reads it back)
    opening = f"<[{gemma.special_ids['<|tool_call>']}]>"
    for parser in ("auto", "none", "gemma4"):
        assert opening in gemma.tool_call_grammar([("get_weather", WEATHER)], True, "tools[{}]", parser)
    assert '"<tool_call>\\n"' in gemma.tool_call_grammar([("get_weather", WEATHER)], True, "tools[{}]", "qwen")


def test_the_detokenized_text_keeps_the_markups_special_tokens_and_drops_the_others(gemma_tokenizer_dir):
    from types import SimpleNamespace

    from ferry.services.api.tokenizer import PromptTokenizer

    tok = PromptTokenizer(str(gemma_tokenizer_dir))
    output = f"<|channel>thought\nHm.<channel|>Ok.{call(f'city:{S}Rome{S},days:2')}<turn|>"
    ids = tok.hf.encode(output, add_special_tokens=False)
    assert tok.special_ids[S] in ids and tok.special_ids["<turn|>"] in ids  # the markup is special tokens here
    parser = tok.output_parser("auto", "auto", TOOLS, SimpleNamespace(text="", ids=[]), False)
    source = parser.text_source()
    text = "".join(source.push(i) for i in ids) + source.flush()
    assert text == output[: -len("<turn|>")]
    assert merged(parser.push(text) + parser.flush()) == [
        ("Reasoning", "Hm."),
        ("Text", "Ok."),
        ("call", "get_weather", {"city": "Rome", "days": 2}),
    ]
    # a model without special markup reads the detokenizer's output as before
    assert (
        PromptTokenizer(str(gemma_tokenizer_dir), tool_call_parser="qwen", reasoning_parser="qwen3")
        .output_parser("auto", "auto", TOOLS, SimpleNamespace(text="", ids=[]), False)
        .text_source()
        is None
    )
