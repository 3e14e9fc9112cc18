"""Structured outputs: a request's `response_format` or forced tool call as an llguidance grammar.

The grammar is built and checked here, in the api (llguidance's core needs no torch), so a schema the
engine cannot compile is a 400 that names the field; it travels to the worker as text
(SamplingParams.grammar), where a matcher per request masks the logits (services/worker/grammar.py).

JSON is written the way `json.dumps` writes it (", " and ": ", no other whitespace): what models were
trained on, and no room for a runaway of blank space. A forced tool call is written in the Qwen/Hermes
format the chat template shows the model, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
its arguments held to the function's parameter schema; the tool-call parser then reads it as any other.

Why llguidance rather than xgrammar or outlines-core: README, "Structured outputs".
"""

from __future__ import annotations

import json

from ferry.shared.errors import InvalidRequest

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg():
    import llguidance

    return llguidance.LLMatcher


def _checked(grammar: str, field: str) -> str:
    error = _llg().validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"{field}: the grammar engine cannot use this schema: {error}")
    return grammar


def _schema_grammar(schema, field: str) -> str:
    try:
        return _llg().grammar_from_json_schema(schema, defaults=JSON_STYLE)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"{field}: not a JSON schema: {exc}") from exc


def response_format_grammar(fmt) -> str | None:
    """The grammar of `response_format` (schema.ResponseFormat), or None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _checked(_schema_grammar({"type": "object"}, "response_format"), "response_format")
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise InvalidRequest("response_format.json_schema.schema: a json_schema response format needs a schema")
        field = "response_format.json_schema.schema"
        return _checked(_schema_grammar(fmt.json_schema.schema, field), field)
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}")


def _call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip


def tool_call_grammar(tools: list[tuple[str, dict]], parallel: bool) -> str:
    """One call (or, with `parallel`, one or more) to one of `tools` [(name, parameters schema)]."""
    for name, params in tools:  # each schema on its own first, so the 400 names the tool
        _checked(_schema_grammar(params, f"tools[{name}].function.parameters"), f"tools[{name}].function.parameters")
    schema = _call_schema(*tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(n, p) for n, p in tools]}
    schema = {**schema, "x-guidance": JSON_STYLE}
    repeat = ' ("\\n" call)*' if parallel else ""
    lark = f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {json.dumps(schema)}\n'
    return _checked(_llg().grammar_from_lark(lark), "tools")
