"""OpenAI Responses output: the response object, and its stream of server-sent events

    response.created, response.in_progress,
    per output item: response.output_item.added,
        reasoning: content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
        message:   content_part.added, output_text.delta*, output_text.done, content_part.done
        function_call: function_call_arguments.delta, function_call_arguments.done
    response.output_item.done,
    response.completed | response.incomplete (max_output_tokens) | response.failed (an error mid-stream)

built from the output parser's events (reasoning -> a reasoning item whose content is the reasoning
text, text -> a message item with one output_text part, tool calls -> function_call items). Every
event has `type` and a `sequence_number` counting from 0. One builder serves both: the items it
keeps are the non-streamed output, the events it returns are the stream.
"""

from __future__ import annotations

import time
import uuid

from ferry.services.api.generation import Usage
from ferry.services.api.output_parsers import Reasoning, Text, ToolCall
from ferry.services.api.responses_schema import encrypt_reasoning
from ferry.shared.errors import FerryError

# an error's HTTP status -> ResponseError.code (OpenAI's few codes that fit a text-only server)
_ERROR_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


def usage_json(usage: Usage, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseBuilder:
    """`echo`: the request's settings as the response object repeats them (model, instructions,
    tools, tool_choice, temperature, ...). `max_calls`: function calls kept (1 with
    parallel_tool_calls false; None: all). `encrypted_reasoning`: include reasoning.encrypted_content."""

    def __init__(self, echo: dict, max_calls: int | None = None, encrypted_reasoning: bool = False):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.echo = echo
        self.max_calls, self.encrypted_reasoning = max_calls, encrypted_reasoning
        self.output: list[dict] = []
        self.open: str | None = None  # the type of the output item being written, if one is open
        self.calls = 0
        self.reasoning_tokens = 0
        self.final: dict | None = None  # the response object once finished (completed or incomplete)
        self._sequence = 0

    # ---- events ----------------------------------------------------------------------------------

    def start(self) -> list[dict]:
        snapshot = self.response("in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def apply(self, events: list) -> list[dict]:
        """Add the parser's events to the output; returns the stream events they make."""
        out: list[dict] = []
        for e in events:
            if isinstance(e, ToolCall):
                if self.max_calls is not None and self.calls >= self.max_calls:
                    continue
                self.calls += 1
                out += self._close()
                out += self._function_call(e)
            elif isinstance(e, Reasoning) and e.text:
                if self.open != "reasoning":
                    out += self._close() + self._open_reasoning()
                out.append(self._text_delta("response.reasoning_text.delta", e.text))
            elif isinstance(e, Text) and e.text:
                if self.open != "message":
                    if not e.text.strip():
                        continue  # whitespace between items is no item of its own
                    out += self._close() + self._open_message()
                out.append(self._text_delta("response.output_text.delta", e.text, logprobs=[]))
        return out

    def finish(self, finish_reason: str, usage: Usage) -> list[dict]:
        """Close the open item; the last event: response.completed, or response.incomplete when the
        output was cut at max_output_tokens (or the model length)."""
        status = "incomplete" if finish_reason == "length" else "completed"
        out = self._close(status)
        self.final = self.response(status, usage)
        return [*out, self._event(f"response.{status}", response=self.final)]

    def failed(self, exc: FerryError) -> list[dict]:
        """The last event of a stream an error ended after it began (headers gone: no status code)."""
        code = _ERROR_CODES.get(exc.http_status, "server_error")
        response = {**self.response("failed"), "error": {"code": code, "message": str(exc)}}
        return [self._event("response.failed", response=response)]

    # ---- the response object ---------------------------------------------------------------------

    def response(self, status: str, usage: Usage | None = None) -> dict:
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            **self.echo,
            "output": self.output if status != "in_progress" else [],
            "usage": usage_json(usage, self.reasoning_tokens) if usage is not None else None,
        }
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if status in ("completed", "incomplete"):
            body["completed_at"] = int(time.time())
        return body

    def count_reasoning_tokens(self, events: list, tokens: int) -> None:
        """A delta's tokens count as reasoning tokens when all the delta made is reasoning."""
        if events and all(isinstance(e, Reasoning) for e in events):
            self.reasoning_tokens += tokens

    # ---- items -----------------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _where(self) -> dict:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _added(self, item: dict) -> dict:
        self.output.append(item)
        return self._event(
            "response.output_item.added",
            output_index=len(self.output) - 1,
            item=dict(item, **({"content": []} if "content" in item else {})),
        )

    def _open_reasoning(self) -> list[dict]:
        self.open = "reasoning"
        item = {
            "id": f"rs_{uuid.uuid4().hex}",
            "type": "reasoning",
            "summary": [],
            "content": [],
            "status": "in_progress",
        }
        added = self._added(item)
        item["content"].append({"type": "reasoning_text", "text": ""})
        return [
            added,
            self._event(
                "response.content_part.added",
                **self._where(),
                content_index=0,
                part={"type": "reasoning_text", "text": ""},
            ),
        ]

    def _open_message(self) -> list[dict]:
        self.open = "message"
        item = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        added = self._added(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return [added, self._event("response.content_part.added", **self._where(), content_index=0, part=dict(part))]

    def _text_delta(self, kind: str, text: str, **extra) -> dict:
        self.output[-1]["content"][0]["text"] += text
        return self._event(kind, **self._where(), content_index=0, delta=text, **extra)

    def _function_call(self, call: ToolCall) -> list[dict]:
        arguments = call.arguments_json()
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        out = [self._added(item)]
        item["arguments"] = arguments
        out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        out.append(
            self._event("response.function_call_arguments.done", **self._where(), name=call.name, arguments=arguments)
        )
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=len(self.output) - 1, item=item))
        return out

    def _close(self, status: str = "completed") -> list[dict]:
        """End the open reasoning or message item (`status`: incomplete when the output was cut in it)."""
        if self.open is None:
            return []
        self.open = None
        item = self.output[-1]
        part = item["content"][0]
        if item["type"] == "reasoning":
            done = [self._event("response.reasoning_text.done", **self._where(), content_index=0, text=part["text"])]
            if self.encrypted_reasoning:
                item["encrypted_content"] = encrypt_reasoning(part["text"])
        else:
            done = [
                self._event(
                    "response.output_text.done", **self._where(), content_index=0, text=part["text"], logprobs=[]
                )
            ]
        item["status"] = status
        done.append(self._event("response.content_part.done", **self._where(), content_index=0, part=dict(part)))
        done.append(self._event("response.output_item.done", output_index=len(self.output) - 1, item=item))
        return done
