"""A chat prompt whose client text is text: only the chat template's own markup is special tokens.

A client's string that spells a special token (`<|im_start|>system\\n...` in a message, a tool result,
a tool's name, description or schema, an argument, a template variable) must not become that token:
it would forge a turn of another role. As OpenAI's API does, the text of every client string is read
as text; the special tokens of the prompt are those the template writes.

How: every client string (values and dict keys, everywhere in messages, tools and template variables)
has each stretch that could make a special token (a whole spelling; a trailing start of one, a leading
end of one, which could join a neighbour into one) replaced by a stand-in character of its own, a
private-use character found in no client string nor in the template. The template renders that; every
special token in the result is then the template's, and cuts the prompt there, the way the tokenizer
cuts at special tokens; the stand-ins are put back into the texts between them, which are tokenized
as text (PromptTokenizer.encode_chat). A stand-in is one character that the string methods and filters
templates use leave as it is (trim, split, tojson), so the client's text comes back where the template
put it. The usual request spells no special token: it renders as before, its text tokenized whole.
(transformers' apply_chat_template(sanitize_control_tokens=True) tokenizes a spelled token apart from
the text beside it, which merges differently at its edges, and bypasses the segment cache: not used.)

The raw prompt of /v1/completions is the client's own whole prompt: special-token text there stays
special (as vLLM's and OpenAI's completions read it); this applies to chat-templated prompts only.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ferry.shared.errors import InvalidRequest

# Supplementary Private Use Area-A: assigned to nothing, so a prompt holds these only if a client sent them
_STAND_IN_FIRST, _STAND_IN_LAST = 0xF0000, 0xFFFFD


@dataclass(frozen=True)
class RenderedChat:
    """A rendered chat prompt: `texts` between the template's own special tokens `specials` (one more
    text than specials). A special token spelled inside a text is a client's: text. `ids`: the prompt's
    token ids where the chat format renders tokens itself (harmony_format.py; its text is then one piece)."""

    texts: tuple[str, ...]
    specials: tuple[str, ...]
    ids: tuple[int, ...] | None = None

    @cached_property
    def text(self) -> str:
        out = [self.texts[0]]
        for special, text in zip(self.specials, self.texts[1:]):
            out += (special, text)
        return "".join(out)

    def plus(self, suffix: str) -> RenderedChat:
        """This prompt with the server's text `suffix` after it."""
        if self.ids is not None:
            if suffix:  # a programming error: such a suffix is a template format's markup
                raise ValueError(f"cannot add text {suffix!r} to a prompt rendered as token ids")
            return self
        return RenderedChat(self.texts[:-1] + (self.texts[-1] + suffix,), self.specials)


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    text: str  # as rendered, client text included (what the output parsers read)


class ClientText:
    """The stretches of client strings that could make one of `specials` (spellings of a tokenizer's special
    tokens): finding them, standing them in, and cutting a rendered prompt at the template's own."""

    def __init__(self, specials: list[str]):
        self.specials = sorted(set(specials), key=len, reverse=True)
        self.spelling = re.compile("|".join(map(re.escape, self.specials)) or "(?!)")  # (?!) never matches
        self._cut = re.compile(f"({self.spelling.pattern})")
        # A trailing start of a special (`<|im_`) or a leading end (`start|>`) could join a neighbouring
        # string into one; those holding whitespace are left, so that a template's trim/strip sees the same ends.
        self._starts = {t[:i] for t in self.specials for i in range(1, len(t)) if not re.search(r"\s", t[:i])}
        self._ends = {t[i:] for t in self.specials for i in range(1, len(t)) if not re.search(r"\s", t[i:])}
        self._longest = max((len(t) for t in self.specials), default=0)
        # A whole client string that is the inside of a special (`|im_end|`) becomes one where the template writes
        # the two ends around it (Qwen3-Coder's `'<' ~ key ~ '>'` for a tool schema's keys). Identifiers are left:
        # templates write those between their own tags (`name`, `id`), and no template here wraps them in `<|..|>`.
        self._interiors = {
            t[i:j]
            for t in self.specials
            for i in range(1, len(t))
            for j in range(i + 1, len(t))
            if not t[i:j].isidentifier() and not re.search(r"\s", t[i:j])
        }
        # a stretch is a spelling, holds a special's first character (a start) or its last (an end): a string
        # without these characters has none, nor does a request whose JSON has none (json.dumps escapes only
        # quotes, backslashes and control characters)
        firsts, lasts = {t[0] for t in self.specials}, {t[-1] for t in self.specials}
        self._first_char, self._last_char, self._edge_char = (
            re.compile("[" + "".join(map(re.escape, sorted(chars))) + "]" if chars else "(?!)")
            for chars in (firsts, lasts, firsts | lasts)
        )
        self._json_shows_edges = not any(c in '"\\' or ord(c) < 0x20 for c in firsts | lasts)

    def stretches(self, s: str) -> list[tuple[int, int]]:
        """The (start, end) spans of `s` to stand in, in order: each spelling of a special, the longest
        start of one that ends `s`, the longest end of one that starts it (overlapping ones merged); all of `s`
        where it is the inside of a special."""
        if s in self._interiors:
            return [(0, len(s))]
        if not self._edge_char.search(s):
            return []
        spans = [m.span() for m in self.spelling.finditer(s)]
        window = self._longest - 1
        # an end of a special that starts `s` ends with a special's last character; a start that ends it
        # begins with a first one: only those places are looked at (the longest that is one wins)
        heads = [m.end() for m in self._last_char.finditer(s, 0, window) if s[: m.end()] in self._ends]
        tails = [
            m.start() for m in self._first_char.finditer(s, max(len(s) - window, 0)) if s[m.start() :] in self._starts
        ]
        if heads:
            spans.insert(0, (0, heads[-1]))
        if tails:
            spans.append((tails[0], len(s)))
        merged: list[tuple[int, int]] = []
        for a, b in sorted(spans):
            if merged and a < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        return merged

    def any_in(self, obj: Any) -> bool:
        """Whether some string in `obj` (values and keys, nested) has a stretch to stand in."""
        if self._json_shows_edges:
            if not self._edge_char.search(json.dumps(obj, ensure_ascii=False, default=str, skipkeys=True)):
                return any(s in self._interiors for s in _strings(obj))
        return any(self.stretches(s) for s in _strings(obj))

    def render(self, render, inputs: dict, template: str) -> RenderedChat:
        """render(**inputs) -> str (the template call), with client strings `inputs` (nested messages,
        tools, variables): cut at the template's own special tokens, client text put back as text."""
        if not self.any_in(inputs):
            text = render(**inputs)
            parts = self._cut.split(text)
            return RenderedChat(tuple(parts[0::2]), tuple(parts[1::2]))
        used = set(template).union(*self.specials, *_strings(inputs))
        free = (chr(c) for c in range(_STAND_IN_FIRST, _STAND_IN_LAST + 1) if chr(c) not in used)
        stand_in: dict[str, str] = {}  # stretch -> its character

        def neutral(s: str) -> str:
            spans = self.stretches(s)
            if not spans:
                return s
            out, at = [], 0
            for a, b in spans:
                stretch = s[a:b]
                if stretch not in stand_in:
                    stand_in[stretch] = next(free, None)
                    if stand_in[stretch] is None:  # (a StopIteration would never reach the request's future)
                        raise InvalidRequest(
                            "the request's text uses every private-use character this server "
                            "stands client text in with; send fewer of U+F0000-U+FFFFD"
                        )
                out += (s[at:a], stand_in[stretch])
                at = b
            out.append(s[at:])
            return "".join(out)

        text = render(**_map_strings(inputs, neutral))
        back = {ord(c): stretch for stretch, c in stand_in.items()}
        parts = self._cut.split(text)
        return RenderedChat(tuple(t.translate(back) for t in parts[0::2]), tuple(parts[1::2]))


def _strings(obj: Any) -> list[str]:
    """The strings in `obj`: itself, or the keys and values of its dicts and lists, nested."""
    out: list[str] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return out


def _map_strings(obj: Any, fn) -> Any:
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_map_strings(v, fn) for v in obj]
    return obj
