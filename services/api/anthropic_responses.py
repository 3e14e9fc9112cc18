"""Anthropic Messages responses: the message object, and its stream of server-sent events

    message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*,
    message_delta (stop_reason, usage), message_stop

built from the output parser's events (reasoning -> thinking blocks, text -> text blocks, tool calls
-> tool_use blocks). One builder serves both: the blocks it keeps are the non-streamed content, the
events it returns are the stream. Errors are {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
import uuid

from ferry.services.api.generation import Usage
from ferry.services.api.output_parsers import Reasoning, Text, ToolCall

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def sse_event(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


PING = {"type": "ping"}


def usage_json(usage: Usage) -> dict:
    """Anthropic's split: input_tokens are the prompt tokens not read from the (prefix) cache."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(finish_reason: str, stop_sequence: str | None, called_tools: bool) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called_tools else "end_turn"


class MessageBuilder:
    def __init__(self, model: str, single_tool_call: bool = False):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.single_tool_call = single_tool_call  # tool_choice.disable_parallel_tool_use
        self.content: list[dict] = []
        self.open: str | None = None  # the type of the block being written, if one is open
        self.tool_calls = 0

    def start(self, prompt_tokens: int) -> list[dict]:
        message = self._message(None, None, {"input_tokens": prompt_tokens, "output_tokens": 0})
        return [{"type": "message_start", "message": {**message, "content": []}}, PING]

    def apply(self, events: list) -> list[dict]:
        """Add the parser's events to the content; returns the stream events they make."""
        out: list[dict] = []
        for e in events:
            if isinstance(e, ToolCall):
                if self.single_tool_call and self.tool_calls:
                    continue
                self.tool_calls += 1
                out += self._close()
                block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}", "name": e.name, "input": {}}
                out += self._open(block)
                block["input"] = e.arguments
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.arguments_json()}))
                out += self._close()
            elif isinstance(e, Reasoning) and e.text:
                if self.open != "thinking":
                    out += self._close() + self._open({"type": "thinking", "thinking": "", "signature": ""})
                self.content[-1]["thinking"] += e.text
                out.append(self._delta({"type": "thinking_delta", "thinking": e.text}))
            elif isinstance(e, Text) and e.text:
                if self.open != "text":
                    if not e.text.strip():
                        continue  # whitespace between blocks is no block of its own
                    out += self._close() + self._open({"type": "text", "text": ""})
                self.content[-1]["text"] += e.text
                out.append(self._delta({"type": "text_delta", "text": e.text}))
        return out

    def finish(self, finish_reason: str, stop_sequence: str | None, usage: Usage) -> list[dict]:
        reason = stop_reason(finish_reason, stop_sequence, self.tool_calls > 0)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
            "usage": usage_json(usage),
        }
        return [*self._close(), delta, {"type": "message_stop"}]

    def message(self, finish_reason: str, stop_sequence: str | None, usage: Usage) -> dict:
        reason = stop_reason(finish_reason, stop_sequence, self.tool_calls > 0)
        return self._message(reason, stop_sequence, usage_json(usage))

    def _message(self, reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.content,
            "stop_reason": reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def _open(self, block: dict) -> list[dict]:
        self.content.append(block)
        self.open = block["type"]
        start = {k: (v if k != "input" else {}) for k, v in block.items()}
        return [{"type": "content_block_start", "index": len(self.content) - 1, "content_block": start}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]
