"""The OpenAI Responses request body (POST /v1/responses) as msgspec structs, and its translation to
what the chat template and the sampler take: input items -> chat-template messages (role/content,
an assistant turn's `tool_calls` and `reasoning_content`, `tool` turns), flat function tools ->
OpenAI-style function specs, sampling fields -> SamplingParams.

As on the chat route (schema.py), every field of OpenAI's request is either taken or refused with a
400 naming it (`refused_fields`; README, "The OpenAI Responses API"); fields outside OpenAI's spec
that we do not know are ignored, as OpenAI's own server ignores them. Input items and tools other
than messages, function calls, their outputs and reasoning (web search, file search, computer use,
MCP, images, files, ...) are refused with a 400 naming the item.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import msgspec

from ferry.services.api.json_limits import check_depth
from ferry.services.api.schema import MAX_TEMPERATURE, problem_field
from ferry.shared.bounds import Int64
from ferry.shared.errors import InvalidRequest
from ferry.shared.sampling import SamplingParams, sampling_problems


class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A message's input_text / output_text part, a reasoning item's reasoning_text or summary_text."""

    type: str
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One item of `input`, all kinds in one struct (a message item may leave out its `type`):
    message (role, content), function_call (call_id, name, arguments), function_call_output
    (call_id, output), reasoning (summary, content, encrypted_content). The stored conversation of
    previous_response_id is a list of these too."""

    type: str = "message"
    role: str | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None
    encrypted_content: str | None = None
    id: str | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the deprecated name of summary
    context: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_obfuscation: bool | None = None  # accepted; no obfuscation padding is sent


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: OpenAI's default, true (kept for previous_response_id)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_output_tokens: Int64 | None = None  # Int64: every integer field is range-checked (400 naming it)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache is automatic here
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    max_tool_calls: Int64 | None = None  # a limit on built-in tool calls: this server offers none
    # beyond OpenAI, as vLLM takes them
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # refused unless null (or a value that asks for nothing): _REFUSED says why
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Int64 | None = None
    access_programs: Any = None
    background_options: Any = None
    context_management: Any = None
    image: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None


SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
ROLES = ("user", "assistant", "system", "developer")
EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh", "max")
THINKING_OFF = ("none", "minimal")  # reasoning.effort values that turn the template's enable_thinking off
ENCRYPTED_REASONING = "reasoning.encrypted_content"
MAX_METADATA = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512

# field -> (the values that ask for nothing, why anything else is refused)
_REFUSED = {
    "background": ((None, False), "background responses are not supported: send the request and wait, or stream"),
    "conversation": ((None,), "conversation objects are not supported: send previous_response_id or the whole input"),
    "prompt": ((None,), "prompt templates are not supported: send instructions and input"),
    "top_logprobs": ((None, 0), "logprobs are not supported on this route: use /v1/chat/completions"),
    "service_tier": ((None, "auto", "default"), "this server has one service tier: send auto or default"),
    "truncation": ((None, "disabled"), "truncation auto is not supported: an input too long for the model is a 400"),
    "prompt_cache_retention": ((None, "in_memory"), "the prefix cache is in memory: send in_memory or leave it out"),
    "access_programs": ((None,), "access programs are not supported"),
    "background_options": ((None,), "background responses are not supported"),
    "context_management": ((None,), "server-side context management (compaction) is not supported"),
    "image": ((None,), "image options are not supported: the served models write text"),
    "moderation": ((None,), "moderation is not supported"),
    "prompt_cache_options": ((None,), "prompt cache options are not supported: the prefix cache is automatic"),
}


def _check(ok: bool, message: str, param: str | None = None) -> None:
    if not ok:
        raise InvalidRequest(message, param=param)


# the body's names of the Submit fields a scheduler's refusal names (Generation's `fields`)
SUBMIT_FIELDS = {"prompt": "input", "max_tokens": "max_output_tokens"}


def validate(req: ResponsesRequest) -> None:
    """What the body asks beyond sampling (SamplingParams' own rules: `sampling_params`), and the ranges
    OpenAI's API sets tighter than the engine's."""
    for field, (fine, why) in _REFUSED.items():
        _check(getattr(req, field) in fine, f"{field}: {why}", field)
    _check(
        req.temperature is None or 0 <= req.temperature <= MAX_TEMPERATURE,
        f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {req.temperature}",
        "temperature",
    )
    _check(
        req.max_output_tokens is None or req.max_output_tokens >= 1,
        f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
        "max_output_tokens",
    )
    _check(
        req.max_tool_calls is None or req.max_tool_calls >= 0,
        f"max_tool_calls must be at least 0, got {req.max_tool_calls}",
        "max_tool_calls",
    )
    for i, value in enumerate(req.include or ()):
        _check(
            value == ENCRYPTED_REASONING,
            f"include[{i}]: only {ENCRYPTED_REASONING!r} is supported, got {value!r}",
            f"include[{i}]",
        )
    if req.reasoning is not None:
        r = req.reasoning
        _check(
            r.effort in EFFORTS,
            f"reasoning.effort must be one of {', '.join(e for e in EFFORTS if e)}, got {r.effort!r}",
            "reasoning.effort",
        )
        for name in ("summary", "generate_summary"):
            value = getattr(r, name)
            _check(
                value in (None, "auto", "concise", "detailed"),
                f"reasoning.{name} must be auto, concise or detailed, got {value!r}",
                f"reasoning.{name}",
            )
        _check(
            r.context in (None, "auto"),
            f"reasoning.context: only auto is supported, got {r.context!r}",
            "reasoning.context",
        )
    if req.text is not None:
        _check(
            req.text.verbosity in (None, "medium"),
            "text.verbosity: verbosity is not supported (medium only)",
            "text.verbosity",
        )
        fmt = req.text.format
        _check(
            fmt is None or fmt.type in ("text", "json_object", "json_schema"),
            f"text.format.type must be text, json_object or json_schema, got {fmt and fmt.type!r}",
            "text.format.type",
        )
        _check(
            fmt is None or fmt.type != "json_schema" or fmt.schema is not None,
            "text.format.schema: a json_schema format needs a schema",
            "text.format.schema",
        )
    meta = req.metadata or {}
    _check(len(meta) <= MAX_METADATA, f"metadata: at most {MAX_METADATA} pairs, got {len(meta)}", "metadata")
    for key, value in meta.items():
        _check(
            len(key) <= MAX_METADATA_KEY and len(value) <= MAX_METADATA_VALUE,
            f"metadata: keys are at most {MAX_METADATA_KEY} characters, values {MAX_METADATA_VALUE}",
            "metadata",
        )


def sampling_params(req: ResponsesRequest, eos_token_ids: tuple[int, ...], grammar: str | None) -> SamplingParams:
    """The request's SamplingParams, from the fields it sent; a 400 naming a field out of range."""
    sent = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
    params = SamplingParams(**sent, stop_token_ids=tuple(dict.fromkeys(eos_token_ids)), grammar=grammar)
    problems = sampling_problems(params)
    _check(not problems, "; ".join(problems), problem_field(problems, ResponsesRequest))
    return params


# ---- input -> chat-template messages ---------------------------------------------------------------


def input_items(req: ResponsesRequest) -> list[InputItem]:
    """`input` as items: a string is one user message."""
    if isinstance(req.input, str):
        _check(req.input != "", "input must not be empty", "input")
        return [InputItem(role="user", content=req.input)]
    _check(len(req.input) > 0 or req.previous_response_id is not None, "input must not be empty", "input")
    return list(req.input)


def _parts_text(parts: str | list[ContentPart] | None, kinds: tuple[str, ...], where: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    for j, part in enumerate(parts):
        _check(
            part.type in kinds and part.text is not None,
            f"{where}[{j}]: only {' and '.join(kinds)} parts are supported (the served models read text), "
            f"got type {part.type!r}",
            f"{where}[{j}]",
        )
    return "".join(p.text for p in parts)


def _arguments(text: str | None, where: str) -> dict:
    """A function_call item's arguments (a JSON string) as the object the chat template takes."""
    try:
        check_depth((text or "").encode())  # JSON in a string: the body's depth check did not see into it
        args = json.loads(text) if (text or "").strip() else {}
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}: {exc}", param=where) from None
    except ValueError:
        raise InvalidRequest(f"{where} is not valid JSON", param=where) from None
    _check(isinstance(args, dict), f"{where} must be a JSON object", where)
    return args


def reasoning_text(item: InputItem, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary, else what this server put
    in encrypted_content (the reasoning, base64: `include: ["reasoning.encrypted_content"]`)."""
    content = _parts_text(item.content, ("reasoning_text",), f"{where}.content")
    if content:
        return content
    summary = "\n".join(p.text or "" for p in item.summary or [])
    if summary or not item.encrypted_content:
        return summary
    try:
        return base64.b64decode(item.encrypted_content, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise InvalidRequest(
            f"{where}.encrypted_content: not reasoning this server wrote (base64 of its text)",
            param=f"{where}.encrypted_content",
        ) from None


def encrypt_reasoning(text: str) -> str:
    """encrypted_content of a reasoning item: the text, base64 (this server keeps no secret; a client
    that sends it back with store false gets its reasoning back into the conversation)."""
    return base64.b64encode(text.encode()).decode()


def template_messages(instructions: str | None, items: list[InputItem], first: int = 0) -> list[dict]:
    """The conversation as chat-template messages. Reasoning, assistant messages and function calls
    that follow one another are one assistant turn (`reasoning_content`, `content`, `tool_calls`); a
    function_call_output is a `tool` turn; developer messages are system messages, and `instructions`
    with the system messages that open the input are one (chat templates take one system message,
    first: Qwen3.5's refuses a second). `first`: the index in `input` of items[0] (earlier items come
    from previous_response_id), for the 400s."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    turn: dict | None = None  # the assistant turn being built
    for k, item in enumerate(items):
        where = f"input[{k - first}]" if k >= first else "previous_response_id"
        if item.type == "message":
            role = item.role
            _check(role in ROLES, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
            kinds = ("output_text", "input_text", "refusal") if role == "assistant" else ("input_text",)
            text = _parts_text(item.content, kinds, f"{where}.content")
            if role == "assistant":
                if turn is None or "tool_calls" in turn:
                    turn = _assistant(out)
                turn["content"] += text
                continue
            _check(text != "", f"{where}.content must not be empty", f"{where}.content")
            turn = None
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif item.type == "reasoning":
            if turn is None or turn["content"] or "tool_calls" in turn:
                turn = _assistant(out)
            text = reasoning_text(item, where)
            turn["reasoning_content"] = (
                (turn["reasoning_content"] + "\n" + text) if "reasoning_content" in turn else text
            )
        elif item.type == "function_call":
            _check(
                item.call_id is not None and item.name is not None,
                f"{where}: a function_call item needs call_id and name",
                where,
            )
            if turn is None:
                turn = _assistant(out)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": _arguments(item.arguments, f"{where}.arguments")},
            }
            turn.setdefault("tool_calls", []).append(call)
        elif item.type == "function_call_output":
            _check(
                item.call_id is not None,
                f"{where}.call_id: a function_call_output names the call it answers",
                f"{where}.call_id",
            )
            turn = None
            output = _parts_text(item.output, ("input_text", "output_text"), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            raise InvalidRequest(
                f"{where}.type: only message, function_call, function_call_output and reasoning "
                f"items are supported, got {item.type!r}",
                param=f"{where}.type",
            )
    _check(bool(out), "input must not be empty", "input")
    return _one_system_message(out)


def _one_system_message(messages: list[dict]) -> list[dict]:
    """The system messages at the start joined into one (a blank line between them)."""
    n = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    if n < 2:
        return messages
    return [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:n])}, *messages[n:]]


def _assistant(out: list[dict]) -> dict:
    turn: dict = {"role": "assistant", "content": ""}
    out.append(turn)
    return turn


def output_items(output: list[dict]) -> list[InputItem]:
    """A response's output as input items: what previous_response_id carries into the next turn."""
    return msgspec.convert(output, list[InputItem])


# ---- tools ------------------------------------------------------------------------------------------


def template_tools(req: ResponsesRequest) -> list[dict] | None:
    """The tools as apply_chat_template(tools=...) takes them; None for none (no tools, or tool_choice none)."""
    choice = req.tool_choice
    if not req.tools:
        _check(choice in (None, "none", "auto"), "tool_choice: no tools were given", "tool_choice")
        return None
    names, out = set(), []
    for i, t in enumerate(req.tools):
        _check(
            t.type == "function",
            f"tools[{i}].type: only function tools are supported, got {t.type!r}",
            f"tools[{i}].type",
        )
        _check(bool(t.name), f"tools[{i}].name: a function tool needs a name", f"tools[{i}].name")
        _check(t.name not in names, f"tools[{i}].name: {t.name!r} is used twice", f"tools[{i}].name")
        names.add(t.name)
        params = t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
        out.append(
            {"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": params}}
        )
    if isinstance(choice, str):
        _check(
            choice in ("none", "auto", "required"),
            f"tool_choice must be none, auto, required or a function, got {choice!r}",
            "tool_choice",
        )
        if choice == "none":
            return None
    elif choice is not None:
        _check(
            choice.type == "function",
            f"tool_choice.type: only a function can be chosen, got {choice.type!r}",
            "tool_choice.type",
        )
        _check(choice.name in names, f"tool_choice.name: {choice.name!r} is not one of the tools", "tool_choice.name")
    return out


def tool_schemas(req: ResponsesRequest) -> dict[str, dict] | None:
    """{name: parameters schema}: the tool-call parser's view; None when no call may be made."""
    if not req.tools or req.tool_choice == "none":
        return None
    return {t.name: t.parameters or {} for t in req.tools}


def forced_tools(req: ResponsesRequest) -> list[tuple[str, dict]] | None:
    """[(name, parameters schema)] the output must call (required: any of them; a function: that
    one); None when no call is forced. Call template_tools first (it checks the names)."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "none", "auto"):
        return None
    tools = [(t.name, t.parameters or {"type": "object"}) for t in req.tools]
    return tools if isinstance(choice, str) else [t for t in tools if t[0] == choice.name]


def parallel_calls(req: ResponsesRequest) -> bool:
    return req.parallel_tool_calls is not False


def tools_json(req: ResponsesRequest) -> list[dict]:
    """The tools as the response object echoes them (FunctionTool)."""
    return [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
            "strict": t.strict,
        }
        for t in req.tools or []
    ]


def tool_choice_json(req: ResponsesRequest) -> str | dict:
    choice = req.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else {"type": choice.type, "name": choice.name}


# ---- template variables, structured output -----------------------------------------------------------


def template_kwargs(req: ResponsesRequest, constrained: bool) -> dict:
    """Chat-template variables: reasoning.effort itself (gpt-oss's templates read it); none/minimal turns
    Qwen3's enable_thinking off, any other effort on (none sent: the template's default); a grammar from
    the first token (a forced call, text.format json) turns it off."""
    if constrained:
        return {"enable_thinking": False}
    effort = req.reasoning.effort if req.reasoning is not None else None
    return {} if effort is None else {"reasoning_effort": effort, "enable_thinking": effort not in THINKING_OFF}


def text_format_schema(req: ResponsesRequest) -> dict | None:
    """The JSON schema text.format holds the output to (json_object: any object); None for plain text."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    return {"type": "object"} if fmt.type == "json_object" else fmt.schema


def text_json(req: ResponsesRequest) -> dict:
    """text as the response object echoes it."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return {"format": {"type": fmt.type if fmt else "text"}, "verbosity": "medium"}
    return {
        "format": {
            "type": "json_schema",
            "name": fmt.name or "response",
            "schema": fmt.schema,
            "description": fmt.description,
            "strict": fmt.strict,
        },
        "verbosity": "medium",
    }
