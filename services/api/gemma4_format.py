"""Gemma 4's chat markup in the model's output: its tool calls, its reasoning, and the grammar of a forced call.

The rules, as Gemma 4's published chat template writes them (and the model was trained to write):
  * a tool call is `<|tool_call>call:NAME{ARGUMENTS}<tool_call|>`; several calls follow one another with nothing
    between them, and the model then ends its turn (`<|tool_response>`, one of the checkpoint's eos ids, or
    `<turn|>`), the results coming back as `<|tool_response>response:NAME{...}<tool_response|>` in the prompt;
  * ARGUMENTS are `key:value` pairs joined by `,`, keys bare and in sorted order; a value is a string between two
    `<|"|>` (its text as it is: no escapes, so it never holds `<|"|>`), a number or `true` / `false` / `null`
    as JSON writes them, an object `{key:value,...}` (bare keys again) or an array `[value,...]`;
  * reasoning is the `thought` channel, `<|channel>thought\\n...<channel|>`, written first when the template's
    `enable_thinking` put `<|think|>` in the system turn; without it the template closes an empty channel
    at the end of the prompt (`<|channel>thought\\n<channel|>`), and the output is the answer.
`<|tool_call>`, `<tool_call|>`, `<|"|>`, `<|channel>` and `<channel|>` are special tokens of Gemma 4's vocabulary:
the detokenizer keeps them in the text these parsers read (MARKUP_TOKENS; tokenizer.py), and the grammar writes
them as those tokens where the vocabulary has them, as text where it has not (a test tokenizer's).

Arguments are read typed as written; where the tool's JSON schema says a value is a string, a bare value is its
text as written (a zip code keeps its leading zero), and a string where the schema wants none of string is the
JSON value it spells, when it spells one of the wanted type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from ferry.services.api.tool_call_parser import ToolCall
from ferry.shared.errors import InvalidRequest

NAME = "gemma4"  # the parsers' name (--tool-call-parser, --reasoning-parser; vLLM's), as the family's
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
STRING = '<|"|>'  # both ends of a string value
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought", "<channel|>"
MARKUP_TOKENS = (CALL_OPEN, CALL_CLOSE, STRING, "<|channel>", THOUGHT_CLOSE)

_CALL = re.compile(r"\s*call:([^\s{}<>:,]+)\s*(\{.*)", re.S)
_BARE_END = ",}]"


class _Malformed(ValueError):
    pass


def _types(schema: Any) -> set[str]:
    """The JSON types a schema admits, as far as its `type`, `enum`, `const` and alternatives say (empty: any)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    out = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    for values in ([schema["const"]] if "const" in schema else [], schema.get("enum") or []):
        out |= {_json_type(v) for v in values}
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            branch_types = _types(branch)
            if not branch_types:
                return set()
            out |= branch_types
    if out & {"integer"}:
        out.add("number")
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", dict: "object", list: "array"}.get(type(value), "string")


class _Reader:
    """One pass over ARGUMENTS text; every method reads one item at `pos` and raises _Malformed where it is not one."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def expect(self, char: str) -> None:
        self.skip()
        if not self.text.startswith(char, self.pos):
            raise _Malformed(f"expected {char!r} at {self.pos}")
        self.pos += len(char)

    def value(self, schema: Any) -> Any:
        self.skip()
        if self.text.startswith(STRING, self.pos):
            return _typed_string(self.string(), schema)
        if self.text.startswith("{", self.pos):
            return self.object(schema)
        if self.text.startswith("[", self.pos):
            return self.array(schema)
        return self.bare(schema)

    def string(self) -> str:
        start = self.pos + len(STRING)
        end = self.text.find(STRING, start)
        if end < 0:
            raise _Malformed("a string is not closed")
        self.pos = end + len(STRING)
        return self.text[start:end]

    def object(self, schema: Any) -> dict:
        self.expect("{")
        props = schema.get("properties") if isinstance(schema, dict) else None
        extra = schema.get("additionalProperties") if isinstance(schema, dict) else None
        out: dict = {}
        self.skip()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return out
        while True:
            key = self.key()
            self.expect(":")
            out[key] = self.value((props or {}).get(key, extra if isinstance(extra, dict) else None))
            self.skip()
            if self.text.startswith("}", self.pos):
                self.pos += 1
                return out
            self.expect(",")

    def key(self) -> str:
        self.skip()
        if self.text.startswith(STRING, self.pos):  # keys the template's escape_keys writes delimited
            return self.string()
        end = self.pos
        while end < len(self.text) and self.text[end] not in ":{}[]," and not self.text.startswith(STRING, end):
            end += 1
        key = self.text[self.pos : end].strip()
        if not key:
            raise _Malformed(f"expected a key at {self.pos}")
        self.pos = end
        return key

    def array(self, schema: Any) -> list:
        self.expect("[")
        items = schema.get("items") if isinstance(schema, dict) else None
        out: list = []
        self.skip()
        if self.text.startswith("]", self.pos):
            self.pos += 1
            return out
        while True:
            out.append(self.value(items))
            self.skip()
            if self.text.startswith("]", self.pos):
                self.pos += 1
                return out
            self.expect(",")

    def bare(self, schema: Any) -> Any:
        end = self.pos
        while end < len(self.text) and self.text[end] not in _BARE_END and not self.text.startswith(STRING, end):
            end += 1
        raw = self.text[self.pos : end].strip()
        if not raw or any(c in raw for c in "{[:"):  # a bare value is a word: structure there is a broken one
            raise _Malformed(f"expected a value at {self.pos}")
        self.pos = end
        if _types(schema) == {"string"}:
            return raw
        try:
            value = json.loads(raw)
        except ValueError:
            return raw  # a bare word: the model left a string undelimited
        return value if not isinstance(value, (dict, list)) else raw


def _typed_string(text: str, schema: Any) -> Any:
    """A delimited string as the schema types it: itself, unless the schema wants none of string and it spells a
    JSON value of a type the schema wants (a model quoting a number)."""
    wanted = _types(schema)
    if not wanted or "string" in wanted:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if _json_type(value) in wanted else text


def parse_arguments(text: str, schema: dict | None = None) -> dict | None:
    """`{ARGUMENTS}` (braces included) -> the arguments, typed by `schema` (the tool's parameters); None when
    the text is not one whole object."""
    reader = _Reader(text)
    try:
        out = reader.object(schema or {})
    except _Malformed:
        return None
    reader.skip()
    return out if reader.pos == len(text) else None


def parse_call(body: str, schemas: dict[str, dict] | None = None) -> ToolCall | None:
    """A call block's inside, `call:NAME{ARGUMENTS}` -> a ToolCall, or None when it is not one."""
    m = _CALL.fullmatch(body.rstrip())
    if m is None:
        return None
    args = parse_arguments(m.group(2), (schemas or {}).get(m.group(1)))
    return ToolCall(m.group(1), args) if args is not None else None


# ---- the grammar of a forced call -------------------------------------------------------------------------------

# keywords that say nothing of which values are valid
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"}
)
# each type's keywords a forced call's grammar holds the values to (any other is a 400 naming the tool)
_NUMBER_KEYS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
_TYPE_KEYS = {
    "string": frozenset({"minLength", "maxLength", "pattern"}),
    "integer": _NUMBER_KEYS,
    "number": _NUMBER_KEYS,
    "boolean": frozenset(),
    "null": frozenset(),
    "object": frozenset({"properties", "required", "additionalProperties", "$defs", "definitions"}),
    "array": frozenset({"items", "minItems", "maxItems"}),
}
_NO_DELIMITER = r'~/(?s:.*)<\|"\|>(?s:.*)/'  # text that never holds the string delimiter
_KEY_TEXT = r"/[A-Za-z_][A-Za-z0-9_.\-]*/"


def call_grammar(
    tools: list[tuple[str, dict]], parallel: bool, max_calls: int, field: str, spell: Callable[[str], str]
) -> str:
    """Lark (llguidance) of one call, or with `parallel` one to `max_calls` calls, to one of `tools` [(name,
    parameters schema)], each call's arguments held to its tool's schema. `spell(markup)`: how the grammar writes
    one of MARKUP_TOKENS (a special token's `<[id]>`, or the text as a quoted literal). `field`: where a tool's
    schema is in the request, with {} for its name, for the 400 of a schema this grammar cannot hold to."""
    builder = _Grammar(spell)
    alternatives = []
    for name, params in tools:
        builder.field, builder.root = field.format(name), params
        try:
            args = builder.rule_of(params, "#")
        except (TypeError, ValueError, AttributeError) as exc:  # a keyword's value of the wrong kind
            raise builder.refuse(f"a keyword's value ({exc})") from exc
        alternatives.append(f"{json.dumps('call:' + name)} {args}")
    calls = f"call{{1,{max_calls}}}" if parallel else "call"
    head = [
        f"start: {calls}",
        f"call: {spell(CALL_OPEN)} ({' | '.join(alternatives)}) {spell(CALL_CLOSE)}",
    ]
    return "\n".join(head + builder.rules + builder.terminals) + "\n"


class _Grammar:
    """The rules of Gemma 4 argument values, one rule per schema met (a `$ref` to the same one shares it)."""

    def __init__(self, spell: Callable[[str], str]):
        self.spell = spell
        self.rules: list[str] = []
        self.terminals: list[str] = []
        self.names: dict[str, str] = {}  # `$ref` (with the tool's field) -> rule
        self.field, self.root = "", {}
        self.string_terminal = self._string_terminal("STRING", "/(?s:.*)/")
        self.generic: str | None = None

    def _new(self, prefix: str) -> str:
        return f"{prefix}{len(self.rules) + len(self.terminals)}"

    def refuse(self, what: str) -> InvalidRequest:
        return InvalidRequest(
            f"{self.field}: a forced Gemma 4 tool call cannot be held to {what}; remove it from the schema or let "
            "the model choose (tool_choice auto)",
            param=self.field,
        )

    def _string_terminal(self, name: str, text_regex: str) -> str:
        """A string value: the delimiters, and between them text matching `text_regex` without the delimiter. Where
        the delimiter is text, the whole string is one terminal (so its end is the first closing delimiter)."""
        delimiter = self.spell(STRING)
        body = f"{name}_TEXT"
        self.terminals.append(f"{body}: {text_regex} & {_NO_DELIMITER}")
        if delimiter.startswith("<["):  # a special token: rules may hold it, terminals may not
            rule = name.lower()
            self.rules.append(f"{rule}: {delimiter} {body} {delimiter}")
            return rule
        self.terminals.append(f"{name}: {delimiter} {body} {delimiter}")
        return name

    def literal(self, value: Any) -> str:
        """A fixed value as Gemma 4 writes it."""
        if isinstance(value, str):
            delimiter = self.spell(STRING)
            return f"{delimiter} {json.dumps(value)} {delimiter}" if value else f"{delimiter} {delimiter}"
        if isinstance(value, bool) or value is None:
            return json.dumps(json.dumps(value))
        if isinstance(value, (int, float)):
            return json.dumps(str(value))
        if isinstance(value, list):
            inner = ' "," '.join(self.literal(v) for v in value)
            return f'"[" {inner} "]"' if inner else '"[" "]"'
        if isinstance(value, dict):
            pairs = ' "," '.join(f"{json.dumps(str(k) + ':')} {self.literal(value[k])}" for k in sorted(value))
            return f'"{{" {pairs} "}}"' if pairs else '"{" "}"'
        raise self.refuse(f"the constant {value!r}")

    def rule_of(self, schema: Any, where: str) -> str:
        """The rule of values matching `schema` (at JSON pointer `where` in the tool's schema)."""
        if schema is True or schema == {} or schema is None:
            return self.any_value()
        if schema is False or not isinstance(schema, dict):
            raise self.refuse(f"the schema at {where}")
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        keys = set(schema) - _ANNOTATIONS
        name = self._new("v")
        self.rules.append("")  # its place: the rule is filled in below (a recursive schema refers to it first)
        index = len(self.rules) - 1
        self.rules[index] = f"{name}: {self.body(schema, keys, where)}"
        return name

    def ref(self, ref: Any) -> str:
        key = f"{self.field} {ref}"
        if key in self.names:
            return self.names[key]
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self.refuse(f"the $ref {ref!r} (only refs into the tool's own schema)")
        target: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise self.refuse(f"the $ref {ref!r}, which points nowhere")
            target = target[part]
        name = self._new("r")
        self.names[key] = name
        self.rules.append(f"{name}: {self.rule_of(target, ref)}")
        return name

    def body(self, schema: dict, keys: set[str], where: str) -> str:
        if "const" in keys:
            return self.literal(schema["const"])
        if "enum" in keys:
            return " | ".join(self.literal(v) for v in schema["enum"])
        for combinator in ("anyOf", "oneOf"):
            if combinator in keys:
                if keys - {combinator, "nullable"}:
                    raise self.refuse(f"{combinator} beside {sorted(keys - {combinator})} at {where}")
                branches = [self.rule_of(s, f"{where}/{combinator}/{i}") for i, s in enumerate(schema[combinator])]
                return " | ".join(branches + (['"null"'] if schema.get("nullable") else []))
        if "allOf" in keys:
            if keys != {"allOf"} or len(schema["allOf"]) != 1:
                raise self.refuse(f"allOf at {where}")
            return self.rule_of(schema["allOf"][0], f"{where}/allOf/0")
        kind = schema.get("type")
        kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
        if not kinds:
            if keys - {"nullable"}:
                raise self.refuse(f"a schema without a type ({sorted(keys)}) at {where}")
            return self.any_value()
        rest = {k: v for k, v in schema.items() if k not in _ANNOTATIONS and k not in ("type", "nullable")}
        if any(k not in _TYPE_KEYS for k in kinds):
            raise self.refuse(f"the type {kind!r} at {where}")
        unknown = set(rest) - set().union(*(_TYPE_KEYS[k] for k in kinds))
        if unknown:
            raise self.refuse(f"{', '.join(sorted(unknown))} at {where}")
        alternatives = [self.typed(k, {x: v for x, v in rest.items() if x in _TYPE_KEYS[k]}, where) for k in kinds]
        if schema.get("nullable") and "null" not in kinds:
            alternatives.append('"null"')
        return " | ".join(alternatives)

    def typed(self, kind: str, rest: dict, where: str) -> str:
        """Values of one JSON type; `rest`: the schema's keywords of that type."""
        if kind == "boolean":
            return '"true" | "false"'
        if kind == "null":
            return '"null"'
        if kind in ("integer", "number"):
            return self.number({"type": kind, **rest})
        if kind == "string":
            return self.string(rest, where)
        if kind == "array":
            return self.array(rest, where)
        return self.object(rest, where)

    def number(self, schema: dict) -> str:
        """A number as JSON writes it, which is how Gemma 4 writes one: llguidance's JSON grammar holds its bounds."""
        name = self._new("n")
        self.rules.append(f"{name}: %json {json.dumps(schema)}")
        return name

    def string(self, rest: dict, where: str) -> str:
        if not rest.keys() & {"minLength", "maxLength", "pattern"}:
            return self.string_terminal
        regexes = []
        if "pattern" in rest:
            pattern = rest["pattern"]
            if not (isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")):
                raise self.refuse(f"the pattern at {where} (only a pattern anchored at both ends, ^...$)")
            regexes.append("/" + pattern[1:-1].replace("/", "\\/") + "/")
        if rest.keys() & {"minLength", "maxLength"}:
            low, high = int(rest.get("minLength", 0)), rest.get("maxLength")
            regexes.append(f"/(?s:.{{{low},{'' if high is None else int(high)}}})/")
        return self._string_terminal(self._new("S"), " & ".join(regexes))

    def array(self, rest: dict, where: str) -> str:
        item = self.rule_of(rest.get("items", True), f"{where}/items")
        low, high = int(rest.get("minItems", 0)), rest.get("maxItems")
        if high is not None and int(high) < low:
            raise self.refuse(f"maxItems below minItems at {where}")
        if high is not None and int(high) == 0:
            return '"[" "]"'
        more = f'("," {item}){{{max(low - 1, 0)},{"" if high is None else int(high) - 1}}}'
        items = f"{item} {more}"
        return f'"[" {items} "]"' if low >= 1 else f'"[" ({items})? "]"'

    def object(self, rest: dict, where: str) -> str:
        props = dict(rest.get("properties") or {})
        required = list(rest.get("required") or [])
        for key in required:  # a required key the schema leaves untyped takes any value
            props.setdefault(key, True)
        extra = rest.get("additionalProperties", True)
        if not props:
            if extra is False:
                return '"{" "}"'
            return self.map_of(self.rule_of(extra, f"{where}/additionalProperties"))
        # the declared keys only, in the sorted order the template writes them; each optional one may be left out
        keys = sorted(props)
        values = {k: self.rule_of(props[k], f"{where}/properties/{k}") for k in keys}
        # tail[i, first]: the keys from the i-th on (`first`: no comma before the next one); "" when none is left
        tail = {(len(keys), True): "", (len(keys), False): ""}
        for i in range(len(keys) - 1, -1, -1):
            for first in (True, False):
                comma = "" if first else '"," '
                pair = f"{comma}{json.dumps(keys[i] + ':')} {values[keys[i]]} {tail[i + 1, False]}".rstrip()
                skip = tail[i + 1, first]
                name = self._new("o")
                if keys[i] in required:
                    self.rules.append(f"{name}: {pair}")
                else:
                    self.rules.append(f"{name}: ({pair}) | {skip}" if skip else f"{name}: ({pair})?")
                tail[i, first] = name
        return f'"{{" {tail[0, True]} "}}"'

    def map_of(self, value: str) -> str:
        name = self._new("m")
        self.rules.append(f'{name}: "{{" ({_KEY_TEXT} ":" {value} ("," {_KEY_TEXT} ":" {value})*)? "}}"')
        return name

    def any_value(self) -> str:
        """Any value (a schema that says nothing): a string, number, boolean, null, object or array of any."""
        if self.generic is None:
            self.generic = "any_value"
            number = self.number({"type": "number"})
            obj = self.map_of("any_value")
            values = f'{self.string_terminal} | {number} | "true" | "false" | "null" | {obj} | any_array'
            self.rules.append(f"any_value: {values}")
            self.rules.append('any_array: "[" (any_value ("," any_value)*)? "]"')
        return self.generic
