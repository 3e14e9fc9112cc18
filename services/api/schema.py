"""The OpenAI request bodies we accept, as msgspec structs (a wrong type names the field), and their
translation to SamplingParams. Unknown fields are ignored, like OpenAI's own server does.

The sampling fields default to None ("not sent"): their defaults and their rules belong to
SamplingParams (shared/sampling.py), which gets only the fields a client sent."""

from __future__ import annotations

import msgspec

from ferry.shared.bounds import Int64
from ferry.shared.errors import InvalidRequest
from ferry.shared.sampling import SamplingParams, sampling_problems
from ferry.services.api.json_limits import check_depth


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Generation(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: Int64 | None = None  # Int64: every integer field is range-checked (400 naming it)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool | None = None
    user: str | None = None


# the body fields that are SamplingParams fields of the same name (stop_token_ids is built, not copied)
SAMPLING_FIELDS = tuple(f for f in SamplingParams.__struct_fields__ if f in _Generation.__struct_fields__
                        and f != "stop_token_ids")  # fmt: skip


class ChatCompletionRequest(_Generation, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None


class CompletionRequest(_Generation, kw_only=True):
    prompt: str | list[str | Int64 | list[Int64]]  # text, token ids, or a batch of one of either
    max_tokens: Int64 | None = 16  # OpenAI's default for completions (chat defaults to the model length)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    if not body.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    check_depth(body)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


def validate_generation(req: _Generation, max_tokens: int | None) -> None:
    """What a body asks beyond sampling (SamplingParams' own rules are checked by `sampling_params`)."""
    _check(req.n == 1, f"n must be 1 (this server returns one choice per request), got {req.n}")
    _check(max_tokens is None or max_tokens >= 1, f"max_tokens must be at least 1, got {max_tokens}")
    if isinstance(req.stop, list):
        _check(len(req.stop) <= 16, f"at most 16 stop strings, got {len(req.stop)}")


def stop_strings(req: _Generation) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def sampling_params(req: _Generation, eos_token_ids: tuple[int, ...]) -> SamplingParams:
    """The request's SamplingParams, from the fields it sent; InvalidRequest naming a field out of range."""
    stop_ids = tuple(req.stop_token_ids or ()) + (() if req.ignore_eos else eos_token_ids)
    sent = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
    params = SamplingParams(**sent, stop_token_ids=tuple(dict.fromkeys(stop_ids)))
    problems = sampling_problems(params)
    _check(not problems, "; ".join(problems))
    return params


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template expects them: role + plain-text content."""
    _check(len(req.messages) > 0, "messages must not be empty")
    out = []
    for i, m in enumerate(req.messages):
        _check(m.role in CHAT_ROLES, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                _check(part.type == "text" and part.text is not None,
                       f"messages[{i}].content[{j}]: only text parts are supported, got type {part.type!r}")  # fmt: skip
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        _check(m.role == "assistant" or content != "", f"messages[{i}].content must not be empty")
        out.append({"role": m.role, "content": content})
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    p = req.prompt
    if isinstance(p, str):
        _check(p != "", "prompt must not be empty")
        return p
    _check(len(p) > 0, "prompt must not be empty")
    if all(isinstance(x, int) for x in p):
        return list(p)
    _check(len(p) == 1, f"prompt: one prompt per request, got a batch of {len(p)}")
    only = p[0]
    _check(not isinstance(only, int), "prompt: mixes token ids and texts")
    _check(len(only) > 0, "prompt must not be empty")
    return only
