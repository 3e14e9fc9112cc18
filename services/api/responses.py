"""OpenAI response bodies and SSE chunks for chat completions and completions."""

from __future__ import annotations

import json
import time
import uuid

from ferry.services.api.generation import Usage


class ResponseFormat:
    """Shared by both routes: ids, timestamps and the usage chunk."""

    object_full: str
    object_chunk: str
    id_prefix: str

    def __init__(self, model: str):
        self.model = model
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list, usage: Usage | None = None, with_usage: bool = False) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            body["usage"] = usage.to_json() if usage else None
        return body

    def opening_chunks(self, with_usage: bool) -> list[dict]:
        return []

    def usage_chunk(self, usage: Usage) -> dict:
        return self._envelope(self.object_chunk, [], usage, with_usage=True)


class ChatFormat(ResponseFormat):
    object_full, object_chunk, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def full(self, text: str, reason: str, usage: Usage) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
        return self._envelope(self.object_full, [choice], usage, with_usage=True)

    def opening_chunks(self, with_usage: bool) -> list[dict]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._envelope(self.object_chunk, [choice], None, with_usage)]

    def chunk(self, text: str, reason: str | None, with_usage: bool) -> dict:
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return self._envelope(self.object_chunk, [choice], None, with_usage)


class CompletionFormat(ResponseFormat):
    object_full, object_chunk, id_prefix = "text_completion", "text_completion", "cmpl"

    def full(self, text: str, reason: str, usage: Usage) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._envelope(self.object_full, [choice], usage, with_usage=True)

    def chunk(self, text: str, reason: str | None, with_usage: bool) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._envelope(self.object_chunk, [choice], None, with_usage)


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def error_body(status: int, error_type: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}
