"""Schemas no finite JSON value matches (issue 57.6): refused where the grammar is built, with a 400 naming
the field, since llguidance compiles them and its matcher dies a few tokens into the output; schemas
that recurse but can end are taken."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ferry.services.api import structured
from ferry.services.api.finite_schema import endless_requirement
from ferry.shared.errors import InvalidRequest

SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
MUTUAL = {
    "$defs": {
        "A": {
            "type": "object",
            "properties": {"b": {"$ref": "#/$defs/B"}},
            "required": ["b"],
            "additionalProperties": False,
        },
        "B": {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/A"}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
    "$ref": "#/$defs/A",
}
NONEMPTY_TREE = {
    "type": "object",
    "required": ["kids"],
    "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
}
NO_WAY_OUT = {
    "type": "object",
    "required": ["a"],
    "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "array", "minItems": 1, "items": {"$ref": "#"}}]}},
}
ENDLESS = [SELF, MUTUAL, NONEMPTY_TREE, NO_WAY_OUT]

FINITE = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # a not required
    {"type": "object", "required": ["kids"], "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
    {
        "type": "object",
        "required": ["next"],
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    },  # a linked list that ends in null
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no type: a string matches
    {
        "$defs": {"N": {"type": "object", "required": ["v"], "properties": {"v": {"type": "integer"}}}},
        "type": "array",
        "items": {"$ref": "#/$defs/N"},
        "minItems": 2,
    },
    True,
    {},
    {"type": "string"},
]


@pytest.mark.parametrize("schema", ENDLESS)
def test_schemas_whose_every_value_nests_another_without_end_are_found(schema):
    assert "without end" in endless_requirement(schema)


@pytest.mark.parametrize("schema", FINITE)
def test_schemas_with_a_finite_value_are_taken(schema):
    assert endless_requirement(schema) is None


@pytest.mark.parametrize("schema", ENDLESS)
def test_an_endless_schema_is_a_400_naming_where_it_is(schema):
    fmt = SimpleNamespace(type="json_schema", json_schema=SimpleNamespace(schema=schema))
    with pytest.raises(InvalidRequest, match="no finite JSON value matches") as exc:
        structured.response_format_grammar(fmt)
    assert exc.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequest) as exc:
        structured.tool_call_grammar([("ok", {"type": "object"}), ("f", schema)], parallel=True)
    assert exc.value.param == "tools[f].function.parameters"
    with pytest.raises(InvalidRequest) as exc:
        structured.json_schema_grammar(schema, "output_config.format.schema")
    assert exc.value.param == "output_config.format.schema"


def test_what_llguidance_finds_unsatisfiable_it_still_names():
    """A required property that may not exist is llguidance's to report (its message says which)."""
    forbidden = {"type": "object", "required": ["b"], "properties": {"a": {}}, "additionalProperties": False}
    with pytest.raises(InvalidRequest, match="required property 'b' is unsatisfiable"):
        structured.json_schema_grammar(forbidden, "output_config.format.schema")
