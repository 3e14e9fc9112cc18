"""The OpenAI request bodies we accept, as msgspec structs (a wrong type names the field), and their
translation to SamplingParams. Every field of OpenAI's chat and completions requests is either taken
or refused with a 400 that names it (`refused_fields`; README, "The OpenAI API: every field"); fields
outside OpenAI's spec that we do not know are ignored, as OpenAI's own server does.

The sampling fields default to None ("not sent"): their defaults and their rules belong to
SamplingParams (shared/sampling.py), which gets only the fields a client sent."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from ferry.services.api.json_limits import check_depth
from ferry.shared.bounds import INT64_MAX, Int64
from ferry.shared.errors import InvalidRequest
from ferry.shared.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams, sampling_problems


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; no obfuscation padding is sent (README's table)


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str | dict | None = None  # OpenAI sends a JSON string; some clients send the object


class ToolCallIn(msgspec.Struct):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to a call
    reasoning_content: str | None = None  # an assistant turn's reasoning, as this server returns it


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct):
    type: str
    function: FunctionDef | None = None


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct):
    type: str
    function: NamedFunction | None = None


class JsonSchemaFormat(msgspec.Struct):
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None


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
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # OpenAI fields this server refuses unless null (or, for some, a value that asks for nothing):
    # REFUSED below says why; README's table lists every field.
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache is automatic here
    safety_identifier: str | None = None


# the body fields that are SamplingParams fields of the same name (stop_token_ids is built, not copied)
SAMPLING_FIELDS = tuple(
    f
    for f in SamplingParams.__struct_fields__
    if f in _Generation.__struct_fields__ and f not in ("stop_token_ids", "logit_bias", "logprobs")
)


class ChatCompletionRequest(_Generation, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None  # none/minimal: the template's enable_thinking off; else on
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra template variables (enable_thinking)
    separate_reasoning: bool = True  # SGLang's: false leaves <think>...</think> in content
    # refused unless null
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: str | None = None


class CompletionRequest(_Generation, kw_only=True):
    prompt: str | list[str | Int64 | list[Int64]]  # text, token ids, or a batch of either
    max_tokens: Int64 | None = 16  # OpenAI's default for completions (chat defaults to the model length)
    logprobs: Int64 | None = None
    echo: bool = False
    best_of: Int64 | None = None
    suffix: str | None = None


MAX_CHOICES = 16  # n
MAX_PROMPTS = 64  # prompts in one completions request, and choices (prompts times n) in one request


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# msgspec ends a validation error with the path of the value it concerns: "... - at `$.messages[0].role`"
_AT_PATH = re.compile(r" - at `\$\.?(.+)`$")


def decode_body(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    if not body.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    check_depth(body)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        at = _AT_PATH.search(str(exc))
        raise InvalidRequest(f"invalid request: {exc}", param=at.group(1) if at else None) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc


def _check(ok: bool, message: str, param: str | None = None) -> None:
    """InvalidRequest(message) unless `ok`; `param`: the field it concerns (the error object's param)."""
    if not ok:
        raise InvalidRequest(message, param=param)


# a stop string's characters: its matcher is built per request on the api's event loop (stop_strings.py)
MAX_STOP_CHARS = 4096
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; the engine's own rule (shared/sampling.py) is only >= 0


def validate_generation(req: _Generation, max_tokens: int | None, allow_zero: bool = False) -> None:
    """What a body asks beyond sampling (SamplingParams' own rules are checked by `sampling_params`),
    and the ranges OpenAI's API sets tighter than the engine's."""
    _check(1 <= req.n <= MAX_CHOICES, f"n must be in [1, {MAX_CHOICES}], got {req.n}", "n")
    _check(
        req.temperature is None or 0 <= req.temperature <= MAX_TEMPERATURE,
        f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {req.temperature}",
        "temperature",
    )
    low = 0 if allow_zero else 1
    field = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    _check(
        max_tokens is None or max_tokens >= low,
        f"max_tokens must be at least {low}{' (0 only scores the prompt, with echo)' if allow_zero else ''}, "
        f"got {max_tokens}",
        field,
    )
    if isinstance(req.stop, list):
        _check(len(req.stop) <= 16, f"at most 16 stop strings, got {len(req.stop)}", "stop")
    longest = max((len(s) for s in stop_strings(req)), default=0)
    _check(
        longest <= MAX_STOP_CHARS, f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}", "stop"
    )
    refused_fields(req)
    for key in getattr(req, "chat_template_kwargs", None) or ():
        _check(
            key not in RESERVED_TEMPLATE_KWARGS,
            f"chat_template_kwargs.{key}: {key!r} is a parameter of the template call, not a template variable"
            + (f"; send the request's own {key} field" if key in ("messages", "tools") else ""),
            f"chat_template_kwargs.{key}",
        )


# The parameters of PromptTokenizer.chat_text and of transformers' apply_chat_template, which
# chat_template_kwargs go to as keywords: one of them there would collide with the call (a TypeError,
# a 500) or change what it does (tokenize, return_dict, chat_template: a template of the client's).
# tests/unit/test_api_http_edge.py checks this list against both signatures.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "self",
        "messages",
        "tools",
        "continue_final",
        "conversation",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# field -> (the values that ask for nothing, why anything else is refused)
_REFUSED = {
    "metadata": ((None,), "metadata is only kept with store, and this server stores no completions"),
    "store": ((None, False), "this server stores no completions"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier: send auto or default"),
    "functions": ((None,), "the deprecated functions field is not supported: send tools"),
    "function_call": ((None,), "the deprecated function_call field is not supported: send tool_choice"),
    "audio": ((None,), "audio output is not supported: the served models write text"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "verbosity": ((None, "medium"), "verbosity is not supported"),
    "suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported"),
}


def refused_fields(req: _Generation) -> None:
    """A 400 naming the first OpenAI field sent with a value this server cannot honour."""
    for field, (fine, why) in _REFUSED.items():
        value = getattr(req, field, None)
        _check(value in fine, f"{field}: {why}", field)
    modalities = getattr(req, "modalities", None)
    _check(modalities is None or list(modalities) == ["text"], 'modalities: only ["text"] is supported', "modalities")
    best_of = getattr(req, "best_of", None)
    _check(
        best_of is None or best_of == req.n,
        f"best_of: only best_of equal to n (or absent) is supported (no server-side ranking), got {best_of}",
        "best_of",
    )
    effort = getattr(req, "reasoning_effort", None)
    _check(
        effort in (None, "none", "minimal", "low", "medium", "high"),
        f"reasoning_effort must be one of none, minimal, low, medium, high, got {effort!r}",
        "reasoning_effort",
    )


def stop_strings(req: _Generation) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)


def sampling_params(
    req: _Generation,
    eos_token_ids: tuple[int, ...],
    vocab_size: int | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    grammar: str | None = None,
) -> SamplingParams:
    """The request's SamplingParams, from the fields it sent; InvalidRequest naming a field out of range."""
    stop_ids = tuple(req.stop_token_ids or ()) + (() if req.ignore_eos else eos_token_ids)
    sent = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
    bias = _logit_bias(req.logit_bias, vocab_size)
    _check(
        grammar is None or not req.ignore_eos,
        "ignore_eos cannot be combined with response_format or a forced tool call: "
        "the output ends where its grammar does",
        "ignore_eos",
    )
    params = SamplingParams(
        **sent,
        stop_token_ids=tuple(dict.fromkeys(stop_ids)),
        logit_bias=bias,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        grammar=grammar,
    )
    problems = sampling_problems(params)
    _check(not problems, "; ".join(problems), problem_field(problems, type(req)))
    return params


def problem_field(problems: list[str], kind: type[msgspec.Struct]) -> str | None:
    """The body field that `sampling_problems` names, when there is one problem and it names one
    (each message begins with the field: "temperature must be >= 0, ...")."""
    if len(problems) != 1:
        return None
    word = re.match(r"[a-z_]+", problems[0])
    return word.group(0) if word and word.group(0) in kind.__struct_fields__ else None


def _logit_bias(bias: dict[str, float] | None, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    out = []
    _check(
        len(bias or ()) <= MAX_LOGIT_BIAS,
        f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias or ())}",
        "logit_bias",
    )
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias: keys must be token ids, got {key[:40]!r}", param="logit_bias") from None
        _check(
            0 <= token < (vocab_size or INT64_MAX),
            f"logit_bias: token id {token} is outside the vocabulary (0..{(vocab_size or INT64_MAX) - 1})",
            "logit_bias",
        )
        _check(
            -100 <= value <= 100,
            f"logit_bias: the bias of token {token} must be in [-100, 100], got {value}",
            "logit_bias",
        )
        out.append((token, float(value)))
    return tuple(out)


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """How many top alternatives the chat request wants with each token's logprob (None: no logprobs)."""
    if req.top_logprobs is not None:
        _check(
            0 <= req.top_logprobs <= MAX_LOGPROBS,
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
            "top_logprobs",
        )
        _check(bool(req.logprobs), "top_logprobs requires logprobs: true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def completion_logprobs(req: CompletionRequest) -> int | None:
    if req.logprobs is not None:
        _check(
            0 <= req.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}",
            "logprobs",
        )
    return req.logprobs


def chat_max_tokens(req: ChatCompletionRequest) -> int | None:
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def submit_fields(req: _Generation) -> dict[str, str]:
    """The body's names of the Submit fields a scheduler's refusal names (Generation's `fields`)."""
    if not isinstance(req, ChatCompletionRequest):
        return {}  # completions: prompt and max_tokens are the body's own
    return {
        "prompt": "messages",
        "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
    }


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template expects them: role + plain-text content; an assistant turn's
    `tool_calls` (arguments as objects) and `reasoning_content`; a tool turn's `tool_call_id`."""
    _check(len(req.messages) > 0, "messages must not be empty", "messages")
    out = []
    for i, m in enumerate(req.messages):
        _check(
            m.role in CHAT_ROLES,
            f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}",
            f"messages[{i}].role",
        )
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                _check(
                    part.type == "text" and part.text is not None,
                    f"messages[{i}].content[{j}]: only text parts are supported, got type {part.type!r}",
                    f"messages[{i}].content[{j}]",
                )
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        _check(
            m.role == "assistant" or content != "", f"messages[{i}].content must not be empty", f"messages[{i}].content"
        )
        msg: dict = {"role": m.role, "content": content}
        if m.tool_calls:
            _check(
                m.role == "assistant",
                f"messages[{i}].tool_calls: only an assistant message makes tool calls",
                f"messages[{i}].tool_calls",
            )
            msg["tool_calls"] = [
                _template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            _check(
                m.tool_call_id is not None,
                f"messages[{i}].tool_call_id: a tool message must name the call it answers",
                f"messages[{i}].tool_call_id",
            )
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content and m.role == "assistant":
            msg["reasoning_content"] = m.reasoning_content
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def _template_call(call: ToolCallIn, where: str) -> dict:
    args = call.function.arguments
    if isinstance(args, str):
        field = f"{where}.function.arguments"
        try:
            # JSON inside a JSON string: the body's depth check did not see into it, and json.loads of a
            # thousand brackets raises RecursionError (a 500), not ValueError
            check_depth(args.encode())
            args = json.loads(args) if args.strip() else {}
        except InvalidRequest as exc:
            raise InvalidRequest(f"{field}: {exc}", param=field) from None
        except ValueError:
            raise InvalidRequest(f"{field} is not valid JSON", param=field) from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args or {}}}


def template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    """The tools as apply_chat_template(tools=...) takes them; None for none (no tools, or tool_choice none)."""
    if not req.tools:
        _check(req.tool_choice in (None, "none", "auto"), "tool_choice: no tools were given", "tool_choice")
        return None
    names = set()
    out = []
    for i, t in enumerate(req.tools):
        _check(
            t.type == "function" and t.function is not None,
            f"tools[{i}].type: only function tools are supported, got {t.type!r}",
            f"tools[{i}].type",
        )
        _check(
            t.function.name not in names,
            f"tools[{i}].function.name: {t.function.name!r} is used twice",
            f"tools[{i}].function.name",
        )
        names.add(t.function.name)
        params = t.function.parameters if t.function.parameters is not None else {"type": "object", "properties": {}}
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t.function.name,
                    "description": t.function.description or "",
                    "parameters": params,
                },
            }
        )
    choice = req.tool_choice
    if isinstance(choice, str):
        _check(
            choice in ("none", "auto", "required"),
            f"tool_choice must be none, auto, required or a named function, got {choice!r}",
            "tool_choice",
        )
        if choice == "none":
            return None
    elif choice is not None:
        _check(
            choice.type == "function" and choice.function is not None,
            f"tool_choice.type: only a named function can be chosen, got {choice.type!r}",
            "tool_choice.type",
        )
        _check(
            choice.function.name in names,
            f"tool_choice.function.name: {choice.function.name!r} is not one of the tools",
            "tool_choice.function.name",
        )
    return out


def tool_schemas(req: ChatCompletionRequest) -> dict[str, dict] | None:
    """{name: parameters schema}: the tool-call parser's view; None when no call may be made."""
    if not req.tools or req.tool_choice == "none":
        return None
    return {t.function.name: t.function.parameters or {} for t in req.tools if t.function is not None}


def forced_tools(req: ChatCompletionRequest) -> list[tuple[str, dict]] | None:
    """[(name, parameters schema)] the output must call (tool_choice required: any of them; a named
    function: that one); None when no call is forced."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "none", "auto"):
        return None
    tools = [(t.function.name, t.function.parameters or {"type": "object"}) for t in req.tools if t.function]
    if isinstance(choice, str):  # required
        return tools
    return [t for t in tools if t[0] == choice.function.name]


def template_kwargs(req: ChatCompletionRequest, forced: bool) -> dict:
    """Chat-template variables: chat_template_kwargs, then reasoning_effort (itself, as gpt-oss's templates
    read it; none/minimal turn Qwen3's enable_thinking off); a grammar from the first token (a forced call,
    response_format) turns it off."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
        kwargs["enable_thinking"] = req.reasoning_effort not in ("none", "minimal")
    if forced:
        kwargs["enable_thinking"] = False
    return kwargs


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one text or token-id list, or a batch of either."""
    p = req.prompt
    if isinstance(p, str):
        _check(p != "", "prompt must not be empty", "prompt")
        return [p]
    _check(len(p) > 0, "prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    _check(not any(isinstance(x, int) for x in p), "prompt: mixes token ids and texts", "prompt")
    _check(len(p) <= MAX_PROMPTS, f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(p)}", "prompt")
    for i, one in enumerate(p):
        _check(len(one) > 0, f"prompt[{i}] must not be empty", f"prompt[{i}]")
    return list(p)
