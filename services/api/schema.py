"""The OpenAI request bodies we accept, as msgspec structs (a wrong type names the field), and their
translation to SamplingParams. Unknown fields are ignored, like OpenAI's own server does."""

from __future__ import annotations

import msgspec

from ferry.shared.errors import InvalidRequest
from ferry.shared.sampling import SamplingParams


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
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    user: str | None = None


class ChatCompletionRequest(_Generation, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_Generation, kw_only=True):
    prompt: str | list[str | int | list[int]]  # text, token ids, or a batch of one of either
    max_tokens: int | None = 16  # OpenAI's default for completions (chat defaults to the model length)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    if not body.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
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
    _check(req.n == 1, f"n must be 1 (this server returns one choice per request), got {req.n}")
    _check(max_tokens is None or max_tokens >= 1, f"max_tokens must be at least 1, got {max_tokens}")
    _check(req.temperature >= 0, f"temperature must be >= 0, got {req.temperature}")
    _check(0 < req.top_p <= 1, f"top_p must be in (0, 1], got {req.top_p}")
    _check(req.top_k >= -1, f"top_k must be -1, 0 (both: disabled) or positive, got {req.top_k}")
    _check(0 <= req.min_p <= 1, f"min_p must be in [0, 1], got {req.min_p}")
    _check(req.repetition_penalty > 0, f"repetition_penalty must be > 0, got {req.repetition_penalty}")
    _check(-2 <= req.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {req.presence_penalty}")
    _check(-2 <= req.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {req.frequency_penalty}")
    if isinstance(req.stop, list):
        _check(len(req.stop) <= 16, f"at most 16 stop strings, got {len(req.stop)}")


def stop_strings(req: _Generation) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def sampling_params(req: _Generation, eos_token_ids: tuple[int, ...]) -> SamplingParams:
    stop_ids = tuple(req.stop_token_ids or ()) + (() if req.ignore_eos else eos_token_ids)
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), min_p=req.min_p, seed=req.seed,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, ignore_eos=req.ignore_eos, stop_token_ids=tuple(dict.fromkeys(stop_ids)),
    )  # fmt: skip


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
