"""OpenAI response bodies and SSE chunks for chat completions and completions.

A request has one or more choices (n, and on completions a batch of prompts); each choice turns its
Generation's deltas into OpenAI's shapes: `ChatChoice` (content, reasoning_content, tool_calls,
logprobs.content) and `CompletionChoice` (text, echo, the legacy logprobs object)."""

from __future__ import annotations

import json
import time
import uuid

from ferry.services.api.generation import Delta, Generation, Usage
from ferry.services.api.logprobs import CompletionLogprobs, TokenText, chat_entries, prompt_positions
from ferry.services.api.output_parsers import Reasoning, Text, ToolCall


def total_usage(gens: list[Generation]) -> Usage:
    """Usage of a request: prompt tokens once per prompt (choices of one prompt share it), output summed."""
    seen: set[int] = set()
    usage = Usage(prompt_tokens=0)
    for g in gens:
        if id(g.prompt) not in seen:
            seen.add(id(g.prompt))
            usage.prompt_tokens += g.usage.prompt_tokens
            usage.cached_tokens += g.usage.cached_tokens
        usage.completion_tokens += g.usage.completion_tokens
    return usage


class ResponseFormat:
    """Shared by both routes: ids, timestamps and the usage chunk."""

    object_full: str
    object_chunk: str
    id_prefix: str

    def __init__(self, model: str):
        self.model = model
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list, usage: Usage | None = None, with_usage: bool = False) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            body["usage"] = usage.to_json() if usage else None
        return body

    def full(self, choices: list[dict], usage: Usage) -> dict:
        return self.envelope(self.object_full, choices, usage, with_usage=True)

    def chunk(self, choice: dict, with_usage: bool) -> dict:
        return self.envelope(self.object_chunk, [choice], None, with_usage)

    def usage_chunk(self, usage: Usage) -> dict:
        return self.envelope(self.object_chunk, [], usage, with_usage=True)


class ChatFormat(ResponseFormat):
    object_full, object_chunk, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"


class CompletionFormat(ResponseFormat):
    object_full, object_chunk, id_prefix = "text_completion", "text_completion", "cmpl"


class ChatChoice:
    """One chat choice: the parser splits reasoning, answer and tool calls; with `logprobs` each token's
    entry (and its top alternatives) goes out with the delta that completes its text."""

    def __init__(self, index: int, parser, token_text: TokenText | None, single_call: bool):
        self.index, self.parser, self.token_text, self.single_call = index, parser, token_text, single_call
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []
        self.logprobs: list[dict] = []
        self.reason: str | None = None

    def opening(self) -> dict:
        return {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def apply(self, d: Delta) -> dict | None:
        """The stream chunk's choice for this delta (None when it carries nothing)."""
        events = self.parser.events(d)
        delta: dict = {}
        for e in events:
            if isinstance(e, Reasoning) and e.text:
                self.reasoning.append(e.text)
                delta["reasoning_content"] = delta.get("reasoning_content", "") + e.text
            elif isinstance(e, Text) and e.text:
                if self.calls and not e.text.strip():
                    continue  # whitespace between calls
                self.content.append(e.text)
                delta["content"] = delta.get("content", "") + e.text
            elif isinstance(e, ToolCall):
                if self.single_call and self.calls:
                    continue
                call = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": e.arguments_json()}}
                self.calls.append(call)
                delta.setdefault("tool_calls", []).append({"index": len(self.calls) - 1, **call})
        entries = None
        if self.token_text is not None:
            entries = chat_entries(
                self.token_text, [(t.token_id, t.logprobs) for t in d.tokens if t.logprobs is not None]
            )
            self.logprobs.extend(entries)
        if d.finish_reason:
            self.reason = "tool_calls" if self.calls and d.finish_reason == "stop" else d.finish_reason
        if not delta and not entries and not d.finish_reason:
            return None
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": {"content": entries, "refusal": None} if entries else None,
            "finish_reason": self.reason if d.finish_reason else None,
        }

    def full(self) -> dict:
        content = "".join(self.content)
        message: dict = {"role": "assistant", "content": None if self.calls and not content.strip() else content}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = self.calls
        logprobs = {"content": self.logprobs, "refusal": None} if self.token_text is not None else None
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.reason}


class CompletionChoice:
    """One completions choice; with `echo` the prompt (text, and its logprobs: the first token's is null)
    comes first; with `logprobs: N` the legacy logprobs object, N alternatives per token."""

    def __init__(self, index: int, gen: Generation, echo_text: str | None, token_text: TokenText | None):
        self.index, self.gen, self.echo_text, self.token_text = index, gen, echo_text, token_text
        self.text: list[str] = []
        self.lp = CompletionLogprobs(token_text) if token_text is not None else None
        self.started = False
        self.reason: str | None = None

    def _prompt_part(self) -> str:
        """Once, before the first output: the echoed prompt and its tokens' logprobs."""
        if self.started:
            return ""
        self.started = True
        if self.echo_text is None:
            return ""
        if self.lp is not None:
            scored = prompt_positions(self.gen.prompt, self.gen.prompt_logprobs)
            for pos, token in enumerate(self.gen.prompt):
                if pos in scored:
                    self.lp.add_position(token, *scored[pos])
                else:
                    self.lp.add(token, None, None)
        return self.echo_text

    def apply(self, d: Delta) -> dict | None:
        since = len(self.lp) if self.lp is not None else 0
        text = self._prompt_part() + d.text
        self.text.append(text)
        if self.lp is not None:
            for t in d.tokens:
                if t.logprobs is not None:
                    self.lp.add_position(t.token_id, t.logprobs)
                else:
                    self.lp.add(t.token_id, None, None)
        if d.finish_reason:
            self.reason = d.finish_reason
        if not text and not d.finish_reason and (self.lp is None or len(self.lp) == since):
            return None
        return {
            "index": self.index,
            "text": text,
            "logprobs": self.lp.to_json(since) if self.lp is not None else None,
            "finish_reason": self.reason if d.finish_reason else None,
        }

    def full(self) -> dict:
        return {
            "index": self.index,
            "text": "".join(self.text),
            "logprobs": self.lp.to_json() if self.lp is not None else None,
            "finish_reason": self.reason,
        }


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def error_body(status: int, error_type: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}
