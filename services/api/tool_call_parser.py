"""Tool calls in streamed output: `<tool_call>…</tool_call>` blocks.

Inside a block, any of the three formats the models write (each as its chat template renders it):
  JSON (Qwen2.5/Qwen3, vLLM's `hermes`):  {"name": "get_weather", "arguments": {"city": "Paris"}}
  XML (Qwen3-Coder/Qwen3.5, `qwen3_coder`): <function=get_weather><parameter=city>Paris</parameter></function>
  GLM (GLM-4.5/4.6/4.7, `glm45`): get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>
XML parameter and GLM argument values are text; they are converted to the type the tool's JSON schema gives
them. A GLM block is the function's name alone, then its arguments: with the request's tools known, a name
that is not one of them is no call (a bare word is all it takes, so that is checked).

Text that could start `<tool_call>` is held back until the next delta decides, as is whitespace
right before a block (it separates the answer from the call, and is not part of either). A complete
block that does not parse (a malformed call) is passed on as the text it was; a block the end of the
output cut off (max_tokens, a stop sequence) is a call if what came parses, else it is dropped: it
is no call, and its raw markup is no part of the answer either.

Route-independent: the Anthropic route makes tool_use blocks of the calls; the OpenAI chat route
can make `tool_calls` of them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
_GLM_CALL = re.compile(r"([^\s<>{}\[\]\"]+)\s*(<arg_key>.*)?", re.S)
_GLM_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)\s*", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def _convert(value: str, schema: dict | None):
    """An XML parameter's text as the JSON type its schema says (strings stay as written)."""
    kind = (schema or {}).get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_tool_call(body: str, schemas: dict[str, dict] | None = None) -> ToolCall | None:
    """One block's inside -> a ToolCall, or None when it is neither format."""
    body = body.strip()
    if body.startswith("<function="):
        m = _FUNCTION.match(body)
        if m is None:
            return None
        name = m.group(1).strip()
        props = ((schemas or {}).get(name) or {}).get("properties", {})
        args = {}
        for p in _PARAMETER.finditer(m.group(2)):
            key = p.group(1).strip()
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _convert(value, props.get(key))
        return ToolCall(name, args)
    if not body.startswith(("{", "[")):
        return _glm_call(body, schemas)
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def _glm_call(body: str, schemas: dict[str, dict] | None) -> ToolCall | None:
    """A GLM block's inside (name, then <arg_key>/<arg_value> pairs, the last one possibly cut off) -> a call."""
    m = _GLM_CALL.fullmatch(body)
    if m is None or (schemas and m.group(1) not in schemas):
        return None
    props = ((schemas or {}).get(m.group(1)) or {}).get("properties", {})
    args, rest = {}, m.group(2) or ""
    for p in _GLM_ARGUMENT.finditer(rest):
        args[p.group(1).strip()] = _convert(p.group(2), props.get(p.group(1).strip()))
    if _GLM_ARGUMENT.sub("", rest):  # anything but argument pairs: not this format
        return None
    return ToolCall(m.group(1), args)


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """push(text) / flush() -> [str | ToolCall]: answer text and complete tool calls, in order. A block runs
    from `open_tag` to `close_tag` (by default `<tool_call>` blocks); `parse` reads its inside (by default
    parse_tool_call; another model's markup brings its own: gemma4_format.py)."""

    def __init__(
        self,
        schemas: dict[str, dict] | None = None,
        open_tag: str = OPEN,
        close_tag: str = CLOSE,
        parse: Callable[[str, dict[str, dict] | None], ToolCall | None] = parse_tool_call,
    ):
        self.schemas = schemas or {}
        self.open, self.close, self.parse = open_tag, close_tag, parse
        self.held = ""  # text not yet decided (a partial <tool_call>, or whitespace before one)
        self.block: str | None = None  # inside a block: what it holds so far
        self.calls = 0

    def push(self, delta: str) -> list[str | ToolCall]:
        text = self.held + delta
        self.held = ""
        out: list[str | ToolCall] = []
        while text:
            if self.block is not None:
                self.block += text  # the closing tag may have begun in an earlier delta
                end = self.block.find(self.close)
                if end < 0:
                    break
                self.block, text = self.block[:end], self.block[end + len(self.close) :]
                out.append(self._close_block(self.block + self.close))
                self.block = None
                continue
            start = text.find(self.open)
            if start >= 0:
                if text[:start].strip():
                    out.append(text[:start].rstrip())
                self.block, text = "", text[start + len(self.open) :]
                continue
            keep = _partial_suffix(text, self.open)
            body = text[: len(text) - keep]
            emit = body.rstrip()
            self.held = text[len(emit) :]
            if emit:
                out.append(emit)
            break
        return out

    def _close_block(self, raw_tail: str) -> str | ToolCall:
        call = self.parse(self.block or "", self.schemas)
        self.calls += call is not None
        return call if call is not None else self.open + raw_tail

    def flush(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        if self.block is not None:  # cut off inside a block: a call if what came parses, else nothing
            call = self.parse(self.block, self.schemas)
            if call is not None:
                self.calls += 1
                out.append(call)
            self.block = None
        elif self.held and (self.held.strip() or not self.calls):  # not the newline after the last call
            out.append(self.held)
        self.held = ""
        return out
