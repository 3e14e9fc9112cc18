"""The model's tokenizer and chat format, through transformers' AutoTokenizer, or rebuilt from a GGUF file's
metadata (shared/tokenizer_source.py; no torch needed).

The chat format (`--chat-format`) says how a chat becomes the prompt and how the output is read back:
`template`, the model's Jinja chat template and the text parsers (--reasoning-parser, --tool-call-parser:
output_parsers.py), or `harmony`, gpt-oss's format, rendered and parsed by OpenAI's harmony library
(harmony_format.py). `auto` (the default) is harmony where the model family declares it
(plan/model_families: ModelFamily.chat_format, for config.json beside the tokenizer) or the chat template
writes harmony's framing (`<|channel|>`, `<|message|>`: gpt-oss's does), else template.

The text parsers' `auto` (--tool-call-parser, --reasoning-parser) is the model family's markup likewise
(ModelFamily.tool_call_parser / reasoning_parser: Gemma 4's own), else qwen / qwen3. A markup whose spellings are
special tokens of the vocabulary (Gemma 4's `<|tool_call>`) keeps them in the detokenized text its parsers read,
and a forced call's grammar writes them as those tokens.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from ferry.services.api.chat_prompt import ChatPrompt, ClientText, RenderedChat
from ferry.services.api.detokenizer import IncrementalDetokenizer
from ferry.services.api.harmony_format import HarmonyChat
from ferry.services.api.output_parsers import REASONING_TAGS, TOOL_CALL_FORMATS, OutputParser
from ferry.services.api.segment_cache import MIN_PROMPT_CHARS, SegmentCache, encode_each
from ferry.shared.eos import eos_token_ids
from ferry.shared.errors import ConfigError, InvalidRequest, ModelLoadError

# Unicode White_Space, what the tokenizers library strips beside a special token with lstrip/rstrip
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(map(chr, range(0x2000, 0x200B)))


class TooLong(InvalidRequest):
    """A prompt refused by its length in characters, before it was tokenized."""


def _family(path: str):
    """The model family of config.json beside the tokenizer; None where there is none, or it is no model Ferry knows."""
    config = Path(path) / "config.json"
    if config.is_file():
        from ferry.plan.model_families import family_for_config

        try:
            return family_for_config(json.loads(config.read_text()), str(config))
        except (ValueError, ConfigError):
            pass
    return None


def chat_format_of(flag: str, path: str, hf: Any) -> str:
    """--chat-format `flag` resolved: `auto` as the module docstring says."""
    if flag != "auto":
        return flag
    template = str(hf.chat_template or "")
    if "<|channel|>" in template and "<|message|>" in template:
        return "harmony"
    family = _family(path)
    return family.chat_format if family is not None else "template"


def parsers_of(tool_calls: str, reasoning: str, path: str) -> tuple[str, str]:
    """(--tool-call-parser, --reasoning-parser) resolved: `auto` as the module docstring says."""
    family = _family(path) if "auto" in (tool_calls, reasoning) else None
    if tool_calls == "auto":
        tool_calls = family.tool_call_parser if family is not None else "qwen"
    if reasoning == "auto":
        reasoning = family.reasoning_parser if family is not None else "qwen3"
    return tool_calls, reasoning


class PromptTokenizer:
    def __init__(
        self, path: str, chat_format: str = "auto", tool_call_parser: str = "auto", reasoning_parser: str = "auto"
    ):
        try:
            from ferry.shared.tokenizer_source import load_tokenizer

            self.hf: Any = load_tokenizer(path)
        except Exception as exc:  # noqa: BLE001 - any failure here means: no usable tokenizer at that path
            raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
        self.eos_token_ids = eos_token_ids(path if Path(path).exists() else None, self.hf)
        self.chat_format = chat_format_of(chat_format, path, self.hf)
        self.harmony = HarmonyChat(self.hf, path) if self.chat_format == "harmony" else None
        if self.harmony is not None:  # the output ends at <|return|> or <|call|>, whatever generation_config says
            self.eos_token_ids = tuple(sorted(set(self.eos_token_ids) | set(self.harmony.stop_ids)))
        self.vocab_size = len(self.hf)
        # The most characters one token can stand for (byte-level vocabularies spell a token with one
        # character per byte, so this bounds the decoded text too): a text longer than
        # max_model_len x this cannot fit the model, whatever it tokenizes to.
        self.longest_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1) or 1
        self.max_model_len: int | None = None  # set from the scheduler's status (routes); None: unchecked
        # long prompts are tokenized segment by segment, the segments sent before looked up (segment_cache.py)
        self.segments = SegmentCache.for_tokenizer(self.hf)
        # {spelling: added token} of the special tokens: in a chat prompt, only the template's are tokens
        self.special_tokens = {t.content: t for t in self.hf.added_tokens_decoder.values() if t.special and t.content}
        self.special_ids = {
            t.content: i for i, t in self.hf.added_tokens_decoder.items() if t.content in self.special_tokens
        }
        self.client_text = ClientText(list(self.special_tokens))
        # the text parsers' names with `auto` resolved; output_parser and tool_call_grammar take them for `auto`
        self.parsers = dict(zip(("tool_calls", "reasoning"), parsers_of(tool_call_parser, reasoning_parser, path)))
        self._markup_cache: dict[tuple[str, str], frozenset[int]] = {}

    def copy(self) -> "PromptTokenizer":
        """Another PromptTokenizer over a copy of the same tokenizer, for another thread (the segment
        cache is shared: it has its own lock, and tokenizes with the tokenizer of the thread asking)."""
        twin = copy.copy(self)
        twin.hf = copy.deepcopy(self.hf)
        return twin

    def check_chars(self, n: int) -> None:
        """Refuse, before tokenizing, a text whose length alone says it cannot fit the model."""
        length = self.max_model_len
        if length and n > length * self.longest_token_chars:
            raise TooLong(
                f"the prompt is {n} characters but the model length is {length} tokens, and no token of "
                f"this model stands for more than {self.longest_token_chars} characters: it cannot fit; "
                "shorten the prompt"
            )

    def chat_prompt(
        self, messages: list[dict], tools: list[dict] | None = None, continue_final: bool = False, **template_kwargs
    ) -> ChatPrompt:
        """The chat prompt of these messages, rendered (render_chat) and tokenized (encode_chat): what
        every chat route sends the model. Client text in it is text, whatever special token it spells."""
        chat = self.render_chat(messages, tools, continue_final, **template_kwargs)
        return ChatPrompt(self.encode_chat(chat), chat.text)

    def render_chat(
        self, messages: list[dict], tools: list[dict] | None = None, continue_final: bool = False, **template_kwargs
    ) -> RenderedChat:
        """The rendered prompt, cut at the template's own special tokens (chat_prompt.py). `tools` go to
        the template (apply_chat_template(tools=...)), which writes them the way the model was trained
        to read them; `continue_final` continues the last (assistant) message instead of opening a new
        turn; other keywords are template variables (Qwen3's `enable_thinking`). The harmony format renders
        the same messages itself (harmony_format.py), its ids in the result."""
        if self.harmony is not None:
            return self.harmony.render(messages, tools, continue_final, template_kwargs)
        if not self.hf.chat_template:
            raise InvalidRequest("this model has no chat template; use /v1/completions")

        def render(messages, tools, variables) -> str:
            try:
                return self.hf.apply_chat_template(
                    messages,
                    tools=tools,
                    add_generation_prompt=not continue_final,
                    continue_final_message=continue_final,
                    tokenize=False,
                    **variables,
                )
            except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the client's to fix
                raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc

        inputs = {"messages": messages, "tools": tools, "variables": template_kwargs}
        return self.client_text.render(render, inputs, str(self.hf.chat_template))

    def encode_chat(self, chat: RenderedChat) -> list[int]:
        """The ids of a rendered chat prompt: its template's special tokens, and its texts as text. With no
        special token spelled in a text, the whole prompt as the tokenizer reads it (encode); else text by
        text, each cut where the tokenizer cuts at a special token (a stripping one takes the whitespace
        beside it), the texts spelling one read as text, the others through the segment cache as encode does.
        A prompt the chat format rendered as ids (harmony) is those ids."""
        if chat.ids is not None:
            return list(chat.ids)
        texts = list(chat.texts)
        spelled = [bool(self.client_text.spelling.search(t)) for t in texts]
        if not any(spelled):
            return self.encode(chat.text)
        self.check_chars(len(chat.text))
        # lstrip/rstrip as the tokenizers library applies them (single_word, normalized: cut at the spelling;
        # the Qwen tokenizers served have none of these flags, and then the cut is exact: SegmentCache.for_tokenizer)
        for i, special in enumerate(chat.specials):
            token = self.special_tokens[special]
            if token.lstrip:
                texts[i] = texts[i].rstrip(_WHITESPACE)
            if token.rstrip:
                texts[i + 1] = texts[i + 1].lstrip(_WHITESPACE)
        plain = [t for t, s in zip(texts, spelled) if not s]
        if self.segments is not None and len(chat.text) >= MIN_PROMPT_CHARS:
            plain_ids = iter(self.segments.encode_segments(plain, self.hf))
        else:
            plain_ids = iter(encode_each(self.hf, plain))
        as_text = iter(encode_each(self.hf, [t for t, s in zip(texts, spelled) if s], as_text=True))
        ids: list[int] = []
        for i, s in enumerate(spelled):
            ids.extend(next(as_text) if s else next(plain_ids))
            if i < len(chat.specials):
                ids.append(self.special_ids[chat.specials[i]])
        return ids

    def output_parser(self, reasoning: str, tool_calls: str, tools: dict[str, dict] | None, prompt, forced: bool):
        """The parser of a chat output in this model's format (output_parsers.OutputParser's arguments, `auto`
        the resolved name; `prompt`: its ChatPrompt). A forced call's grammar writes the text markup of the
        tool-call parser whatever the format (tool_call_grammar), so that output is read by the text parser in
        every format. The text comes from a detokenizer that keeps the markup's special tokens, where it has any."""
        if self.harmony is not None and not forced:
            calls = tools if tool_calls != "none" else None
            return self.harmony.output_parser(calls, reasoning != "none", prompt.ids)
        # a forced output is in the markup its grammar wrote (tool_call_grammar), even under --tool-call-parser none
        tool_calls = (
            self.parsers["tool_calls"] if tool_calls == "auto" or (forced and tool_calls == "none") else tool_calls
        )
        reasoning = self.parsers["reasoning"] if reasoning == "auto" else reasoning
        keep = self._markup_ids(tool_calls, reasoning)
        text = IncrementalDetokenizer(self.hf, keep) if keep else None
        return OutputParser(reasoning, tool_calls, tools, prompt_text=prompt.text, forced=forced, text=text)

    def _markup_ids(self, tool_calls: str, reasoning: str) -> frozenset[int]:
        """The special tokens spelled in the markup the parsers read. A parser turned off ("none") keeps its
        model's markup too: the client then reads the reasoning or the calls as the model wrote them."""
        names = (
            self.parsers["tool_calls"] if tool_calls == "none" else tool_calls,
            self.parsers["reasoning"] if reasoning == "none" else reasoning,
        )
        if names not in self._markup_cache:
            markup = TOOL_CALL_FORMATS[names[0]].markup + REASONING_TAGS[names[1]]
            ids = (i for spelling, i in self.special_ids.items() if any(spelling in m for m in markup))
            self._markup_cache[names] = frozenset(ids)
        return self._markup_cache[names]

    def tool_call_grammar(self, tools: list[tuple[str, dict]], parallel: bool, field: str, tool_calls: str) -> str:
        """The grammar of a forced call (one, or with `parallel` several) to one of `tools` [(name, parameters
        schema)] in the markup of the tool-call parser `tool_calls` (`auto`, `none`: the resolved one); `field`: where a
        tool's schema is in the request, with {} for its name. The markup's special tokens are written as tokens."""
        calls = TOOL_CALL_FORMATS[self.parsers["tool_calls"] if tool_calls in ("auto", "none") else tool_calls]
        return calls.grammar(tools, parallel, field, self.spell)

    def spell(self, markup: str) -> str:
        """`markup` as a grammar (llguidance's lark) writes it: its special token's id, else the text."""
        token = self.special_ids.get(markup)
        return f"<[{token}]>" if token is not None else json.dumps(markup)

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids of `text`: every special token spelled in it is that token (a raw
        prompt's reading: /v1/completions is the client's whole prompt; chat prompts: encode_chat)."""
        self.check_chars(len(text))
        if self.segments is not None and len(text) >= MIN_PROMPT_CHARS:
            return self.segments.encode(text, self.hf)
        return self.hf.encode(text, add_special_tokens=False)

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return prompt
