"""The reasoning and tool-call parsers on fixed model output, streamed in every way it can be cut:
whatever the deltas, the events (merged) are those of the whole text at once."""

from __future__ import annotations

import json

import pytest

from ferry.services.api.output_parsers import OutputParser, ToolCall
from ferry.services.api.reasoning_parser import prompt_opens_reasoning
from ferry.services.api.tool_call_parser import parse_tool_call

WEATHER = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}


def merged(events) -> list:
    """Consecutive reasoning / text events joined; tool calls as (name, arguments)."""
    out = []
    for e in events:
        if isinstance(e, ToolCall):
            out.append(("call", e.name, e.arguments))
        elif out and out[-1][0] == type(e).__name__:
            out[-1] = (out[-1][0], out[-1][1] + e.text)
        else:
            out.append((type(e).__name__, e.text))
    return out


def parse(text: str, cuts, **kw) -> list:
    parser = OutputParser(kw.pop("reasoning", "qwen3"), kw.pop("tool_calls", "qwen"), kw.pop("tools", WEATHER), **kw)
    events, last = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.push(text[last:cut])
        last = cut
    return merged(events + parser.flush())


def every_split(text: str, **kw):
    """The whole text at once, then every cut into two and into single characters: all agree."""
    whole = parse(text, [], **dict(kw))
    for i in range(1, len(text)):
        assert parse(text, [i], **dict(kw)) == whole, f"cut at {i}: {text[:i]!r} | {text[i:]!r}"
    assert parse(text, range(1, len(text)), **dict(kw)) == whole
    return whole


def test_plain_text_passes_through_unchanged():
    text = "The ferry leaves at noon.\n\nBring <b>tags</b> and < signs, even <tool or <thin.\n"
    assert every_split(text) == [("Text", text)]
    assert every_split(text, tools=None) == [("Text", text)]


def test_qwen3_thinking_then_answer():
    text = "<think>\nThe user wants weather.\nI should answer.\n</think>\n\nIt is sunny."
    assert every_split(text) == [("Reasoning", "The user wants weather.\nI should answer."), ("Text", "It is sunny.")]


def test_reasoning_opened_by_the_template_has_only_the_closing_tag():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert prompt_opens_reasoning(prompt) and not prompt_opens_reasoning("<think>\n\n</think>\n\n")
    text = "Let me think.\n</think>\n\nDone."
    assert every_split(text, prompt_text=prompt) == [("Reasoning", "Let me think."), ("Text", "Done.")]
    # cut off by max_tokens inside the reasoning: all of it is reasoning
    assert every_split("Still thinking", prompt_text=prompt) == [("Reasoning", "Still thinking")]


def test_think_later_in_the_answer_is_text_and_none_parser_keeps_tags():
    assert every_split("Answer: <think>x</think>") == [("Text", "Answer: <think>x</think>")]
    text = "<think>hm</think>ok"
    assert every_split(text, reasoning="none", tools=None) == [("Text", text)]


def test_hermes_json_tool_call_after_thinking_and_text():
    text = (
        "<think>\nNeed the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    )
    assert every_split(text) == [
        ("Reasoning", "Need the tool."),
        ("Text", "Let me check."),
        ("call", "get_weather", {"city": "Paris", "days": 2}),
    ]


def test_two_calls_and_xml_format_with_schema_types():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
        '</parameter>\n</function>\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
        '"{\\"city\\": \\"Oslo\\"}"}\n</tool_call>\n'
    )
    assert every_split(text) == [
        ("call", "get_weather", {"city": "New York", "days": 3}),
        ("call", "get_weather", {"city": "Oslo"}),
    ]


def test_malformed_calls_stay_text_cut_off_ones_are_dropped_and_no_tools_means_no_parsing():
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert every_split(bad) == [("Text", bad)]
    # cut off (max_tokens, a stop sequence) inside a call: no call, and its raw markup is no answer either
    cut = '<tool_call>\n{"name": "get_weather", "argu'
    assert every_split(cut) == []
    assert every_split("It is sunny.\n\n" + cut) == [("Text", "It is sunny.")]
    done = '<tool_call>\n{"name": "get_weather", "arguments": {}}'  # complete JSON, closing tag not reached
    assert every_split(done) == [("call", "get_weather", {})]
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert every_split(call, tools=None) == [("Text", call)]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


@pytest.mark.parametrize("tail", ["", "\n", "\n<tool_c", '\n<tool_call>\n{"name": "get_wea', "\n<tool_call>\n{}"])
def test_a_forced_output_is_only_its_calls_whatever_the_cut(tail):
    """A grammar-forced output (tool_choice required / any / a named tool) holds calls and their
    separators; cut off anywhere, no raw markup comes out as text, and --tool-call-parser none does
    not matter (the grammar wrote the format)."""
    want = [("call", "get_weather", {"city": "Rome"})] * 2
    for tool_calls in ("qwen", "none"):
        assert every_split(CALL + "\n" + CALL + tail, tool_calls=tool_calls, forced=True) == want
    prompt = "<|im_start|>assistant\n<think>\n"  # no reasoning is split off a forced output
    assert every_split(CALL + tail, forced=True, prompt_text=prompt) == want[:1]


@pytest.mark.parametrize(
    "body, name, args",
    [
        ('{"name": "f", "arguments": {"a": [1, 2]}}', "f", {"a": [1, 2]}),
        ('{"name": "f", "parameters": {"a": 1}}', "f", {"a": 1}),
        ('{"name": "f"}', "f", {}),
        ('<function=f>\n<parameter=a>\n{"k": 1}\n</parameter>\n</function>', "f", {"a": {"k": 1}}),
    ],
)
def test_parse_tool_call_bodies(body, name, args):
    call = parse_tool_call(body)
    assert (call.name, call.arguments) == (name, args) and json.loads(call.arguments_json()) == args
    assert call.id.startswith("call_")


@pytest.mark.parametrize("body", ['{"arguments": {}}', "[1, 2]", '{"name": "f", "arguments": 3}', "<function=f"])
def test_parse_tool_call_refuses_what_is_not_a_call(body):
    assert parse_tool_call(body) is None


def test_glm_calls_with_argument_pairs_typed_by_the_schema():
    """GLM-4.5/4.6's template writes name, then <arg_key>/<arg_value> pairs on their own lines; GLM-4.7's
    the same without the newlines; values are text, typed by the tool's schema."""
    text = (
        "<think>Weather.</think>Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>42</arg_value></tool_call>"
    )
    assert every_split(text, tool_calls="glm45") == [
        ("Reasoning", "Weather."),
        ("Text", "Checking."),
        ("call", "get_weather", {"city": "New York", "days": 3}),
        ("call", "get_weather", {"city": "42"}),  # a string by its schema, though it reads as a number
    ]
    # cut off inside a value: the call as far as it came; inside a key or the name: no call, no markup
    assert every_split("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par") == [
        ("call", "get_weather", {"city": "Par"})
    ]
    assert every_split("<tool_call>get_weather\n<arg_key>ci") == []
    assert every_split("<tool_call>get_wea") == []


@pytest.mark.parametrize(
    "body, name, args",
    [
        ("f", "f", {}),
        ('f\n<arg_key>a</arg_key>\n<arg_value>{"k": [1]}</arg_value>\n', "f", {"a": {"k": [1]}}),
        ("f<arg_key>a</arg_key><arg_value>x y</arg_value><arg_key>b</arg_key><arg_value>true</arg_value>", "f",
         {"a": "x y", "b": True}),
    ],
)  # fmt: skip
def test_parse_glm_tool_call_bodies(body, name, args):
    call = parse_tool_call(body)
    assert (call.name, call.arguments) == (name, args)


@pytest.mark.parametrize(
    "body, schemas",
    [
        ("get_time", WEATHER),  # a name that is not one of the request's tools
        ("f is here", None),  # words, not a name and arguments
        ("f\n<arg_key>a</arg_key> stray <arg_value>1</arg_value>", None),
        ("f\n<arg_value>1</arg_value>", None),  # a value without its key
    ],
)
def test_glm_bodies_that_are_not_calls_are_refused(body, schemas):
    assert parse_tool_call(body, schemas) is None
