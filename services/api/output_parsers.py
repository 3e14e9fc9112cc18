"""The model's output as a client of a chat route wants it: reasoning, answer text and tool calls,
from the detokenized stream, by the parsers `--reasoning-parser` and `--tool-call-parser` name.

    OutputParser(...).push(delta) -> [Reasoning | Text | ToolCall]      (and .flush() at the end)
    OutputParser(...).events(generation_delta): the same, for a route's Generation delta

The harmony format (gpt-oss) reads tokens, not text: harmony_format.HarmonyOutputParser has the same
`events`; PromptTokenizer.output_parser gives a route the one its model's chat format reads.

Shared by the routes: the Anthropic Messages route makes thinking / text / tool_use blocks of the
events; the OpenAI chat route can make reasoning_content / content / tool_calls deltas of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.services.api.config import REASONING_PARSERS, TOOL_CALL_PARSERS
from ferry.services.api.reasoning_parser import Piece, ReasoningParser, prompt_opens_reasoning
from ferry.services.api.tool_call_parser import ToolCall, ToolCallParser

__all__ = ["Event", "OutputParser", "Reasoning", "Text", "ToolCall", "REASONING_PARSERS", "TOOL_CALL_PARSERS"]


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
    or a stop sequence cut the output, only the unfinished start of another."""

    def __init__(
        self,
        reasoning: str,
        tool_calls: str,
        tools: dict[str, dict] | None,
        prompt_text: str = "",
        forced: bool = False,
    ):
        if reasoning not in REASONING_PARSERS or tool_calls not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown parser: {reasoning!r} / {tool_calls!r}")
        self.forced = forced
        self.reasoning = None
        if reasoning != "none" and not forced:
            self.reasoning = ReasoningParser(starts_in_reasoning=prompt_opens_reasoning(prompt_text))
        self.tools = None
        if (tool_calls != "none" or forced) and tools is not None:
            self.tools = ToolCallParser(tools)

    def text_source(self) -> None:
        """What the request's Generation reads its text from: these parsers read the detokenized text."""
        return None

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
