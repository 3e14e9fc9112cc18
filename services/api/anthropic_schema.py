"""The Anthropic Messages request body (POST /v1/messages, /v1/messages/count_tokens) as msgspec
structs, and its translation to what the chat template and the sampler take: messages in the form
transformers' chat templates expect (role/content, `tool_calls`, role `tool`, `reasoning_content`),
tools as OpenAI-style function specs (apply_chat_template(tools=...)), SamplingParams.

Unknown fields (cache_control, metadata, service_tier, ...) are ignored, as Anthropic's clients
send them freely; content the served models cannot take (images, documents, Anthropic's server
tools) is refused with a message that says so.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from ferry.services.api.schema import MAX_STOP_CHARS
from ferry.shared.bounds import Int64
from ferry.shared.errors import InvalidRequest
from ferry.shared.sampling import SamplingParams, sampling_problems


class TextBlock(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str


class ImageBlock(msgspec.Struct, tag_field="type", tag="image", kw_only=True):
    source: Any = None


class DocumentBlock(msgspec.Struct, tag_field="type", tag="document", kw_only=True):
    source: Any = None


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[Union[TextBlock, ImageBlock, DocumentBlock]] | None = None
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking", kw_only=True):
    data: str = ""


Block = Union[TextBlock, ImageBlock, DocumentBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock]


class Message(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent; Anthropic's own tools (bash_20250124, web_search_...) name a version


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int64 | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    """Structured outputs: {"type": "json_schema", "schema": {...}}, the only type the API defines."""

    type: str
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct, kw_only=True):
    format: OutputFormat | None = None  # its other fields (effort) ask nothing of this server, and are ignored


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured-outputs beta's first form: output_config.format now


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Int64
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = 1.0
    top_p: float | None = None
    top_k: Int64 | None = None


def _check(ok: bool, message: str, param: str | None = None) -> None:
    """InvalidRequest(message) unless `ok` (the message names the field: Anthropic's errors carry no param)."""
    if not ok:
        raise InvalidRequest(message, param=param)


def validate(req: MessagesRequest) -> None:
    """The Messages API's own ranges (temperature [0, 1], narrower than the engine's >= 0)."""
    _check(req.max_tokens >= 1, f"max_tokens: must be at least 1, got {req.max_tokens}")
    _check(0 <= req.temperature <= 1, f"temperature: must be in [0, 1], got {req.temperature}")
    _check(req.top_p is None or 0 < req.top_p <= 1, f"top_p: must be in (0, 1], got {req.top_p}")
    _check(req.top_k is None or req.top_k >= 0, f"top_k: must be >= 0, got {req.top_k}")
    stops = req.stop_sequences or []
    _check(len(stops) <= 16, f"stop_sequences: at most 16, got {len(stops)}")
    _check(all(s for s in stops), "stop_sequences: must not contain an empty string")
    longest = max((len(s) for s in stops), default=0)
    _check(longest <= MAX_STOP_CHARS, f"stop_sequences: at most {MAX_STOP_CHARS} characters each, got {longest}")


def sampling_params(req: MessagesRequest, eos_token_ids: tuple[int, ...], grammar: str | None = None) -> SamplingParams:
    """The request's SamplingParams, held to shared/sampling.py's rules where the request is built
    (`validate` has refused what the Messages API itself does not allow). `grammar`: a forced tool
    call's (structured.tool_call_grammar of `forced_tools`)."""
    params = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p if req.top_p is not None else 1.0,
        top_k=req.top_k or 0,
        stop_token_ids=tuple(eos_token_ids),
        grammar=grammar,
    )
    problems = sampling_problems(params)
    _check(not problems, "; ".join(problems))
    return params


def _text_of(blocks: list, where: str) -> str:
    parts = []
    for i, b in enumerate(blocks):
        _check(isinstance(b, TextBlock), f"{where}[{i}]: only text blocks are supported here, got {_kind(b)}")
        parts.append(b.text)
    return "".join(parts)


def _kind(block) -> str:
    return type(block).__struct_config__.tag  # the block's "type"


def _unsupported(block, where: str) -> None:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        raise InvalidRequest(f"{where}: {_kind(block)} blocks are not supported: this server serves text-only models")


def system_text(req: CountTokensRequest) -> str | None:
    if req.system is None:
        return None
    return req.system if isinstance(req.system, str) else _text_of(req.system, "system")


def template_messages(req: CountTokensRequest) -> list[dict]:
    """The conversation as chat-template messages. A user turn's tool_result blocks become `tool`
    messages (Qwen's templates wrap them in <tool_response>); an assistant turn's tool_use blocks its
    `tool_calls`, its thinking its `reasoning_content`."""
    _check(len(req.messages) > 0, "messages: must not be empty")
    out: list[dict] = []
    system = system_text(req)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        blocks = [TextBlock(text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "user":
            out.extend(_user_turn(blocks, where))
        else:
            out.append(_assistant_turn(blocks, where))
    return out


def _user_turn(blocks: list, where: str) -> list[dict]:
    turn, text = [], []
    for j, b in enumerate(blocks):
        _unsupported(b, f"{where}[{j}]")
        if isinstance(b, ToolResultBlock):
            content = b.content if isinstance(b.content, str) else _tool_result_text(b.content or [], f"{where}[{j}]")
            turn.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
        elif isinstance(b, TextBlock):
            text.append(b.text)
        else:
            raise InvalidRequest(f"{where}[{j}]: a {_kind(b)} block belongs in an assistant turn")
    if text or not turn:
        turn.append({"role": "user", "content": "".join(text)})
    return turn


def _tool_result_text(blocks: list, where: str) -> str:
    for k, b in enumerate(blocks):
        _unsupported(b, f"{where}.content[{k}]")
    return "".join(b.text for b in blocks)


def _assistant_turn(blocks: list, where: str) -> dict:
    text, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        _unsupported(b, f"{where}[{j}]")
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thinking.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}})
        elif isinstance(b, ToolResultBlock):
            raise InvalidRequest(f"{where}[{j}]: a tool_result block belongs in a user turn")
    turn: dict = {"role": "assistant", "content": "".join(text)}
    if thinking:
        turn["reasoning_content"] = "\n".join(thinking)
    if calls:
        turn["tool_calls"] = calls
    return turn


def template_tools(req: CountTokensRequest) -> list[dict] | None:
    """The tools as apply_chat_template(tools=...) takes them (OpenAI function specs); None for none
    (no tools, or tool_choice none)."""
    if not req.tools:
        _check(
            req.tool_choice is None or req.tool_choice.type in ("auto", "none"),
            "tool_choice: any and tool need tools, and none were given",
        )
        return None
    out, names = [], set()
    for i, t in enumerate(req.tools):
        _check(
            t.type in (None, "custom"),
            f"tools[{i}]: {t.type!r} is one of Anthropic's own tools, whose definition this server does not "
            "have; declare it as a custom tool with a name, a description and an input_schema",
        )
        _check(t.name not in names, f"tools[{i}]: the name {t.name!r} is used twice")
        names.add(t.name)
        schema = t.input_schema if t.input_schema is not None else {"type": "object", "properties": {}}
        out.append(
            {"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": schema}}
        )
    choice = req.tool_choice
    if choice is not None and choice.type == "tool":
        _check(choice.name in names, f"tool_choice.name: {choice.name!r} is not one of the tools given")
    if choice is not None and choice.type == "none":
        return None  # no call may be made: the model is not shown the tools (there is no grammar to forbid a call)
    return out


def tool_schemas(req: CountTokensRequest) -> dict[str, dict] | None:
    """{name: input schema}, the tool-call parser's view of the tools; None when no call may be made."""
    if not req.tools or (req.tool_choice is not None and req.tool_choice.type == "none"):
        return None
    return {t.name: t.input_schema or {} for t in req.tools}


def output_format(req: CountTokensRequest) -> tuple[dict, str] | None:
    """(the JSON schema the answer's text must match, where it is in the body) when the request asks for
    structured outputs (output_config.format, or the beta's earlier top-level output_format); None for
    free text. A 400 naming the field for a type other than json_schema, a missing schema, or with a
    forced tool call (the answer is then calls, not text)."""
    fmt, where = _format(req)
    if fmt is None:
        return None
    _check(fmt.type == "json_schema", f"{where}.type: only json_schema is supported, got {fmt.type!r}", f"{where}.type")
    _check(fmt.schema is not None, f"{where}.schema: a json_schema format needs a schema", f"{where}.schema")
    _check(
        not forced(req),
        f"{where}: cannot be combined with tool_choice any or tool (the answer is then tool calls)",
        where,
    )
    return fmt.schema, f"{where}.schema"


def _format(req: CountTokensRequest) -> tuple[OutputFormat | None, str]:
    """The request's output format, unchecked, and its field."""
    if req.output_config is not None and req.output_config.format is not None:
        return req.output_config.format, "output_config.format"
    return req.output_format, "output_format"


def constrained(req: CountTokensRequest) -> bool:
    """A grammar holds the output from its first token: a forced tool call, or an output format."""
    return forced(req) or _format(req)[0] is not None


def forced(req: CountTokensRequest) -> bool:
    """tool_choice any or tool: the answer is tool calls, held to them by a grammar."""
    return bool(req.tools) and req.tool_choice is not None and req.tool_choice.type in ("any", "tool")


def forced_tools(req: CountTokensRequest) -> list[tuple[str, dict]] | None:
    """[(name, input schema)] the output must call (tool_choice any: any of them; tool: that one), for
    structured.tool_call_grammar; None when no call is forced. Call template_tools first (it checks
    the names)."""
    if not forced(req):
        return None
    tools = [(t.name, t.input_schema if t.input_schema is not None else {"type": "object"}) for t in req.tools]
    if req.tool_choice.type == "tool":
        return [t for t in tools if t[0] == req.tool_choice.name]
    return tools


def parallel_calls(req: CountTokensRequest) -> bool:
    """Whether one turn may hold several calls (Anthropic's default; disable_parallel_tool_use: one)."""
    return not (req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use)


# a thinking budget as OpenAI's reasoning_effort, which gpt-oss's templates (and the harmony format) read: a
# budget under 4096 tokens asks for short reasoning (low), under 16384 for medium, a larger one for high
EFFORT_BUDGETS = ((4096, "low"), (16384, "medium"))


def thinking_effort(budget_tokens: int | None) -> str | None:
    """The reasoning_effort of an enabled thinking budget (None: no budget, the template's default)."""
    if budget_tokens is None:
        return None
    return next((effort for limit, effort in EFFORT_BUDGETS if budget_tokens < limit), "high")


def template_kwargs(req: CountTokensRequest) -> dict:
    """Extra chat-template variables: Qwen3's templates read `enable_thinking`, gpt-oss's `reasoning_effort`
    (from the budget: thinking_effort). Without a `thinking` field the template's own default holds; a forced
    tool call (tool_choice any/tool) never thinks first, nor does an answer held to an output format (its
    grammar holds the output from the first token)."""
    if forced(req):
        _check(
            req.thinking is None or req.thinking.type == "disabled",
            "thinking may not be enabled when tool_choice forces tool use",
        )  # Anthropic's own rule
        return {"enable_thinking": False}
    if constrained(req):
        _check(
            req.thinking is None or req.thinking.type == "disabled",
            "thinking: this server cannot think before an answer held to output_config.format (its grammar "
            "holds the output from the first token); send thinking disabled, or no output format",
            "thinking",
        )
        return {"enable_thinking": False}
    if req.thinking is None:
        return {}
    effort = thinking_effort(req.thinking.budget_tokens) if req.thinking.type == "enabled" else None
    return {"enable_thinking": req.thinking.type != "disabled", **({"reasoning_effort": effort} if effort else {})}
