"""Reasoning in streamed output: `<think>…</think>` (Qwen3, DeepSeek-R1) split from the answer.

Two ways a model's reasoning starts: it writes `<think>` itself first (Qwen3-30B-A3B), or the chat
template already put `<think>` at the end of the prompt, so the output opens inside the reasoning
and only `</think>` appears (Qwen3.5/3.6, thinking models): `prompt_opens_reasoning` tells which.
Text that could be the start of a tag is held back until the next delta decides, so a client never
sees half a tag; the newlines the templates put around the tags are dropped. Without any tag the
parser passes the text through unchanged (it only holds leading whitespace until it knows).

Route-independent: the Anthropic route makes thinking blocks of the reasoning; the OpenAI chat
route can make `reasoning_content` of it.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt_text: str, open_tag: str = OPEN) -> bool:
    """Whether the rendered prompt ends inside an open reasoning tag (`open_tag`; the template opened it)."""
    return prompt_text.rstrip().endswith(open_tag)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class Piece:
    kind: str  # "reasoning" | "content"
    text: str


class ReasoningParser:
    """push(delta) / flush() -> [Piece]. States: `start` (nothing but whitespace seen yet, a <think>
    may still open), `reasoning`, `content` (for good: a <think> later in the answer is text). `open_tag` and
    `close_tag`: the reasoning's tags (by default <think> and </think>; another model's: gemma4_format.py)."""

    def __init__(self, starts_in_reasoning: bool = False, open_tag: str = OPEN, close_tag: str = CLOSE):
        self.open, self.close = open_tag, close_tag
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.held = ""
        self.strip = starts_in_reasoning  # drop the whitespace right after a tag

    def push(self, delta: str) -> list[Piece]:
        text = self.held + delta
        self.held = ""
        out: list[Piece] = []
        while text:
            if self.strip:
                text = text.lstrip()
                if not text:
                    break
                self.strip = False
            if self.state == "start":
                stripped = text.lstrip()
                if not stripped or self.open.startswith(stripped):
                    self.held = text  # whitespace, or the start of <think>: wait for more
                    break
                if stripped.startswith(self.open):
                    self.state, self.strip, text = "reasoning", True, stripped[len(self.open) :]
                    continue
                self.state = "content"
            if self.state == "content":
                out.append(Piece("content", text))
                break
            end = text.find(self.close)  # reasoning
            if end >= 0:
                if text[:end].strip():
                    out.append(Piece("reasoning", text[:end].rstrip()))
                self.state, self.strip, text = "content", True, text[end + len(self.close) :]
                continue
            keep = _partial_suffix(text, self.close)
            body = text[: len(text) - keep]
            emit = body.rstrip()  # whitespace may come right before </think>: hold it with the partial tag
            self.held = text[len(emit) :]
            if emit:
                out.append(Piece("reasoning", emit))
            break
        return out

    def flush(self) -> list[Piece]:
        held, self.held = self.held, ""
        if self.state == "reasoning":  # cut off inside the reasoning (max_tokens)
            return [Piece("reasoning", held.rstrip())] if held.strip() else []
        return [Piece("content", held)] if held else []
