"""The model's output as a client of a chat route wants it: reasoning, answer text and tool calls,
from the detokenized stream, by the parsers `--reasoning-parser` and `--tool-call-parser` name.

    OutputParser(...).push(delta) -> [Reasoning | Text | ToolCall]      (and .flush() at the end)
    OutputParser(...).events(generation_delta): the same, for a route's Generation delta

Each parser name stands for a model's markup: TOOL_CALL_FORMATS (the call blocks, how their inside is read, and the
grammar that writes a forced call in them) and REASONING_TAGS; "auto" is resolved by the tokenizer (the model
family's names: tokenizer.py), and a name it did not resolve reads as qwen / qwen3.

The harmony format (gpt-oss) reads tokens, not text: harmony_format.HarmonyOutputParser has the same
`events`; PromptTokenizer.output_parser gives a route the one its model's chat format reads.

Shared by the routes: the Anthropic Messages route makes thinking / text / tool_use blocks of the
events; the OpenAI chat route can make reasoning_content / content / tool_calls deltas of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ferry.services.api import gemma4_format, reasoning_parser, structured, tool_call_parser
from ferry.services.api.config import REASONING_PARSERS, TOOL_CALL_PARSERS
from ferry.services.api.reasoning_parser import Piece, ReasoningParser, prompt_opens_reasoning
from ferry.services.api.tool_call_parser import ToolCall, ToolCallParser

__all__ = ["Event", "OutputParser", "Reasoning", "Text", "ToolCall", "REASONING_PARSERS", "TOOL_CALL_PARSERS"]


@dataclass(frozen=True)
class ToolCallFormat:
    open: str
    close: str
    parse: Callable[[str, dict[str, dict] | None], ToolCall | None]  # a block's inside -> a call, or None
    # (tools [(name, parameters schema)], parallel, field of a tool's schema with {} for its name, spell) -> the
    # grammar of a forced call in this markup; spell(markup) writes one of `markup` as the grammar names it
    grammar: Callable[[list[tuple[str, dict]], bool, str, Callable[[str], str]], str]
    markup: tuple[str, ...]  # the spellings the parser must see (kept in the text where they are special tokens)


QWEN_CALLS = ToolCallFormat(
    tool_call_parser.OPEN,
    tool_call_parser.CLOSE,
    tool_call_parser.parse_tool_call,
    lambda tools, parallel, field, spell: structured.tool_call_grammar(tools, parallel, field),
    (tool_call_parser.OPEN, tool_call_parser.CLOSE, reasoning_parser.OPEN, reasoning_parser.CLOSE),
)
GEMMA4_CALLS = ToolCallFormat(
    gemma4_format.CALL_OPEN,
    gemma4_format.CALL_CLOSE,
    gemma4_format.parse_call,
    lambda tools, parallel, field, spell: structured.markup_tool_call_grammar(
        tools, field, lambda: gemma4_format.call_grammar(tools, parallel, structured.MAX_CALLS, field, spell)
    ),
    gemma4_format.MARKUP_TOKENS,
)
# "none" (and "auto" unresolved) still names the markup a forced call is written in: the default's
TOOL_CALL_FORMATS = {name: QWEN_CALLS for name in TOOL_CALL_PARSERS} | {gemma4_format.NAME: GEMMA4_CALLS}
REASONING_TAGS = {name: (reasoning_parser.OPEN, reasoning_parser.CLOSE) for name in REASONING_PARSERS} | {
    gemma4_format.NAME: (gemma4_format.THOUGHT_OPEN, gemma4_format.THOUGHT_CLOSE)
}


@dataclass
class Reasoning:
    text: str


@dataclass
class Text:
    text: str


Event = Reasoning | Text | ToolCall


class OutputParser:
    """`reasoning`: a REASONING_PARSERS name ("none": no reasoning is split off). `tools`: the
    request's tools as {name: JSON schema of the arguments}; None when the request offers none (or
    must not call one), and then no tool call is parsed. `prompt_text`: the rendered prompt, which
    says whether the output starts inside the reasoning. `forced`: a grammar holds the output to
    tool calls (a forced tool choice: structured.tool_call_grammar), so it is read as calls whatever
    `tool_calls` names (the grammar writes that format), no reasoning is split off, and no text is
    passed on: between the calls there is only their separator, and after them, when max_tokens
    or a stop sequence cut the output, only the unfinished start of another. `text`: where the request's
    Generation reads the text from (push(token_id) -> text, flush() -> text: a detokenizer keeping the markup's
    special tokens, tokenizer.py); None: the tokenizer's detokenized output."""

    def __init__(
        self,
        reasoning: str,
        tool_calls: str,
        tools: dict[str, dict] | None,
        prompt_text: str = "",
        forced: bool = False,
        text=None,
    ):
        if reasoning not in REASONING_PARSERS or tool_calls not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown parser: {reasoning!r} / {tool_calls!r}")
        self.forced, self.text = forced, text
        self.reasoning = None
        if reasoning != "none" and not forced:
            open_tag, close_tag = REASONING_TAGS[reasoning]
            starts_in_reasoning = prompt_opens_reasoning(prompt_text, open_tag)
            self.reasoning = ReasoningParser(starts_in_reasoning, open_tag, close_tag)
        self.tools = None
        if (tool_calls != "none" or forced) and tools is not None:
            calls = TOOL_CALL_FORMATS[tool_calls]
            self.tools = ToolCallParser(tools, calls.open, calls.close, calls.parse)

    def text_source(self):
        """What the request's Generation reads its text from (None: the tokenizer's detokenized output)."""
        return self.text

    def events(self, delta) -> list[Event]:
        """The events of a Generation delta (its text; the last delta flushes)."""
        return self.push(delta.text) + (self.flush() if delta.finish_reason else [])

    def push(self, delta: str) -> list[Event]:
        pieces = self.reasoning.push(delta) if self.reasoning else [Piece("content", delta)]
        return self._route(pieces, final=False)

    def flush(self) -> list[Event]:
        pieces = self.reasoning.flush() if self.reasoning else []
        return self._route(pieces, final=True)

    def _route(self, pieces: list[Piece], final: bool) -> list[Event]:
        out: list[Event] = []
        for piece in pieces:
            text = piece.text
            if piece.kind == "reasoning":
                out.append(Reasoning(text))
            elif self.tools is None:
                if text:
                    out.append(Text(text))
            else:
                out.extend(self._text_or_call(e) for e in self.tools.push(text))
        if final and self.tools is not None:
            out.extend(self._text_or_call(e) for e in self.tools.flush())
        return [e for e in out if isinstance(e, ToolCall)] if self.forced else out

    @staticmethod
    def _text_or_call(e: str | ToolCall) -> Text | ToolCall:
        return Text(e) if isinstance(e, str) else e
