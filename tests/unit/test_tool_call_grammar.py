"""The forced tool-call grammar (structured.tool_call_grammar) run by llguidance over the tiny tokenizer,
as the worker's matcher runs it: where the output may end, and where it must."""

from __future__ import annotations

import json

import pytest

from ferry.services.api import structured
from ferry.shared.errors import InvalidRequest

TIME = (
    "get_time",
    {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)


def call(zone: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {"zone": zone}}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def matcher(tiny_tokenizer_dir):
    import llguidance
    from transformers import AutoTokenizer

    from ferry.services.worker.grammar import tokenizer_factory

    hf = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    llg = tokenizer_factory(tiny_tokenizer_dir, len(hf), [eos])()

    newline = hf.encode("\n", add_special_tokens=False)
    assert len(newline) == 1

    def allowed_after(grammar: str, text: str) -> set[str]:
        """What the grammar allows next after `text`: "end" (the end-of-sequence token), "\\n", other tokens."""
        m = llguidance.LLMatcher(llg, grammar)
        assert m.consume_tokens(hf.encode(text, add_special_tokens=False)) and not m.is_error(), m.get_error()
        bias = m.compute_logit_bias()  # one byte per token, non-zero where it is allowed
        ids = {i for i in range(len(hf)) if bias[i]}
        return {"end" if i == eos else "\n" if i == newline[0] else hf.decode([i]) for i in ids}

    return allowed_after


def test_parallel_calls_may_end_after_any_call_and_must_after_max_calls(matcher):
    grammar = structured.tool_call_grammar([TIME], parallel=True)
    for n in range(1, structured.MAX_CALLS):  # it may end here, or write another call
        assert matcher(grammar, "\n".join(call("UTC") for _ in range(n))) == {"end", "\n"}
    assert matcher(grammar, "\n".join(call("CET") for _ in range(structured.MAX_CALLS))) == {"end"}


def test_a_single_call_ends_after_it(matcher):
    assert matcher(structured.tool_call_grammar([TIME], parallel=False), call("UTC")) == {"end"}
    assert "end" not in matcher(structured.tool_call_grammar([TIME], parallel=False), call("UTC")[:-3])


def test_a_schema_the_engine_cannot_use_is_a_400_naming_where_it_is():
    bad = ("f", {"type": "string", "pattern": "(?<=a)b"})
    with pytest.raises(InvalidRequest, match=r"tools\[f\]\.function\.parameters"):
        structured.tool_call_grammar([bad], parallel=True)
    with pytest.raises(InvalidRequest, match=r"tools\[f\]\.input_schema"):
        structured.tool_call_grammar([bad], parallel=True, field="tools[{}].input_schema")


def _order_schema(item_field: str) -> dict:
    """A Pydantic model's schema with a nested list of items: the items' model under $defs, refs into it."""
    from typing import Literal

    from pydantic import BaseModel, Field, create_model

    item = create_model("Item", **{item_field: (Literal["bolt", "nut"], ...)}, qty=(int, Field(ge=1, le=9)))

    class Order(BaseModel):
        items: list[item] = Field(min_length=1, max_length=3)
        rush: bool

    schema = Order.model_json_schema()
    assert schema["properties"]["items"]["items"] == {"$ref": "#/$defs/Item"}
    return schema


def _tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_forced_calls_resolve_each_tools_own_defs(matcher):
    """Each tool's $defs (Pydantic's nested models) resolve inside the call grammar, to that tool's own:
    two tools define an Item of different shapes, and each call is held to its own."""
    a, b = ("order_a", _order_schema("part")), ("order_b", _order_schema("kind"))
    for parallel in (False, True):
        grammar = structured.tool_call_grammar([a, b], parallel=parallel)
        good_a = _tool_call("order_a", {"items": [{"part": "nut", "qty": 2}], "rush": True})
        good_b = _tool_call(
            "order_b", {"items": [{"kind": "bolt", "qty": 9}, {"kind": "nut", "qty": 1}], "rush": False}
        )
        assert "end" in matcher(grammar, good_a) and "end" in matcher(grammar, good_b)
        wrong = _tool_call("order_a", {"items": [{"kind": "nut", "qty": 2}], "rush": True})  # order_b's Item
        with pytest.raises(AssertionError):
            matcher(grammar, wrong)
    assert matcher(structured.tool_call_grammar([a], parallel=False), good_a) == {"end"}


def test_a_tool_schema_referring_to_its_own_root_stays_a_root(matcher):
    tree = {
        "type": "object",
        "properties": {"v": {"enum": [1, 2]}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"],
        "additionalProperties": False,
    }
    grammar = structured.tool_call_grammar([("tree", tree)], parallel=False)
    assert matcher(grammar, _tool_call("tree", {"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 1}]})) == {"end"}
