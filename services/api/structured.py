"""Structured outputs: a request's `response_format` (Anthropic's `output_config.format`) or forced tool
call as an llguidance grammar.

The grammar is built and checked here, in the api (llguidance's core needs no torch), so a schema the
engine cannot compile, or that no finite value matches (finite_schema.py), is a 400 that names the
field; it travels to the worker as text (SamplingParams.grammar), where a matcher per request masks the
logits (services/worker/grammar.py).

JSON is written the way `json.dumps` writes it (", " and ": ", no other whitespace): what models were
trained on, and no room for a runaway of blank space. A forced tool call is written in the markup of the
model's tool-call parser (output_parsers.TOOL_CALL_FORMATS): Gemma 4's in its own (gemma4_format.py), the others' in the
Qwen/Hermes format the chat template shows the model, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
its arguments held to the function's parameter schema; the tool-call parser then reads it as any other.
Both routes use it: OpenAI's tool_choice required / a named function, Anthropic's any / tool.

With parallel calls allowed, the grammar may end after any complete call (the end-of-sequence token
is then one of the allowed tokens) and ends for certain after MAX_CALLS of them: a model that keeps
calling (a random one writes another call about half the time; a real one caught in a loop) then
stops with its calls instead of running to max_tokens and cutting the last one off.

Why llguidance rather than xgrammar or outlines-core: README, "Structured outputs".
"""

from __future__ import annotations

import json
from collections.abc import Callable

from ferry.services.api.finite_schema import endless_requirement
from ferry.shared.errors import InvalidRequest

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CALLS = 4  # calls in one forced turn, at most (parallel calls allowed)


def _llg():
    import llguidance

    return llguidance.LLMatcher


MAX_ERROR_CHARS = 2000  # llguidance's errors may quote the grammar whole (twice its size): the 400 carries this much


def _checked(grammar: str, field: str) -> str:
    error = _llg().validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"{field}: the grammar engine cannot use this schema: {_clipped(error)}", param=field)
    return grammar


def _schema_grammar(schema, field: str) -> str:
    try:
        return _llg().grammar_from_json_schema(schema, defaults=JSON_STYLE)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"{field}: not a JSON schema: {_clipped(str(exc))}", param=field) from exc


def _checked_schema(schema, field: str) -> str:
    """The grammar of a JSON schema that llguidance compiles and that some finite value matches (an
    endless one llguidance compiles too, and then its matcher dies a few tokens into the output)."""
    grammar = _checked(_schema_grammar(schema, field), field)
    if (endless := endless_requirement(schema)) is not None:
        raise InvalidRequest(f"{field}: no finite JSON value matches this schema: {endless}", param=field)
    return grammar


def _clipped(error: str) -> str:
    return error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS] + f"... ({len(error)} characters)"


def response_format_grammar(fmt) -> str | None:
    """The grammar of `response_format` (schema.ResponseFormat), or None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _checked(_schema_grammar({"type": "object"}, "response_format"), "response_format")
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise InvalidRequest(
                "response_format.json_schema.schema: a json_schema response format needs a schema",
                param="response_format.json_schema.schema",
            )
        return _checked_schema(fmt.json_schema.schema, "response_format.json_schema.schema")
    raise InvalidRequest(
        f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}", param="response_format.type"
    )


def json_schema_grammar(schema, field: str) -> str:
    """The grammar of an answer that is a JSON value matching `schema` (Anthropic's output_config.format);
    `field`: where the schema is in the request, for the 400."""
    return _checked_schema(schema, field)


def _call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


# keywords whose values are data, not schemas: a {"$ref": ...} inside one is a value, never rewritten
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# keywords whose values map names to schemas: the names are never keywords
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebased(schema, base: str):
    """`schema` with each local `$ref` ("#" and a JSON pointer into `schema`) pointing where `schema` now
    sits, `base` (a JSON pointer into the larger schema it is placed in): its `$defs` (Pydantic's nested
    models), `definitions` and `#` itself resolve there as they did in `schema`."""
    if isinstance(schema, list):
        return [_rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(s, base) for name, s in value.items()}
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, base)
    return out


def markup_tool_call_grammar(tools: list[tuple[str, dict]], field: str, lark: Callable[[], str]) -> str:
    """A forced call in a model's own markup, whose arguments are not JSON (gemma4_format.call_grammar): each
    tool's schema is checked as tool_call_grammar checks it first (the 400 names the tool), then `lark()` is built
    and checked."""
    for name, params in tools:
        _checked_schema(params, field.format(name))
    return _checked(_llg().grammar_from_lark(lark()), "tools")


def tool_call_grammar(
    tools: list[tuple[str, dict]], parallel: bool, field: str = "tools[{}].function.parameters"
) -> str:
    """One call (or, with `parallel`, one to MAX_CALLS) to one of `tools` [(name, parameters schema)].
    `field`: where a tool's schema is in the request, for the 400 (the Anthropic route: input_schema).
    Each tool's schema goes whole under the call schema's `$defs` (its refs rebased there), and the
    call's arguments refer to it: a ref into the tool's own schema would not resolve where it is nested."""
    for name, params in tools:  # each schema on its own first, so the 400 names the tool
        _checked_schema(params, field.format(name))
    defs = {f"tool{i}": _rebased(params, f"/$defs/tool{i}") for i, (_, params) in enumerate(tools)}
    calls = [_call_schema(name, {"$ref": f"#/$defs/tool{i}"}) for i, (name, _) in enumerate(tools)]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "$defs": defs, "x-guidance": JSON_STYLE}
    repeat = f' ("\\n" call){{0,{MAX_CALLS - 1}}}' if parallel else ""
    lark = f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {json.dumps(schema)}\n'
    return _checked(_llg().grammar_from_lark(lark), "tools")
