"""Structured outputs: a request's `response_format` or forced tool call as an llguidance grammar.

The grammar is built and checked here, in the api (llguidance's core needs no torch), so a schema the
engine cannot compile is a 400 that names the field; it travels to the worker as text
(SamplingParams.grammar), where a matcher per request masks the logits (services/worker/grammar.py).

JSON is written the way `json.dumps` writes it (", " and ": ", no other whitespace): what models were
trained on, and no room for a runaway of blank space. A forced tool call is written in the Qwen/Hermes
format the chat template shows the model, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
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
            raise InvalidRequest("response_format.json_schema.schema: a json_schema response format needs a schema",
                                 param="response_format.json_schema.schema")  # fmt: skip
        field = "response_format.json_schema.schema"
        return _checked(_schema_grammar(fmt.json_schema.schema, field), field)
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}",
                         param="response_format.type")  # fmt: skip


def _call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip


def tool_call_grammar(tools: list[tuple[str, dict]], parallel: bool,
                      field: str = "tools[{}].function.parameters") -> str:  # fmt: skip
    """One call (or, with `parallel`, one to MAX_CALLS) to one of `tools` [(name, parameters schema)].
    `field`: where a tool's schema is in the request, for the 400 (the Anthropic route: input_schema)."""
    for name, params in tools:  # each schema on its own first, so the 400 names the tool
        _checked(_schema_grammar(params, field.format(name)), field.format(name))
    schema = _call_schema(*tools[0]) if len(tools) == 1 else {"anyOf": [_call_schema(n, p) for n, p in tools]}
    schema = {**schema, "x-guidance": JSON_STYLE}
    repeat = f' ("\\n" call){{0,{MAX_CALLS - 1}}}' if parallel else ""
    lark = f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {json.dumps(schema)}\n'
    return _checked(_llg().grammar_from_lark(lark), "tools")
