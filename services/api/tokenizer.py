"""The model's tokenizer and chat template, through transformers' AutoTokenizer (no torch needed)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ferry.services.api.segment_cache import MIN_PROMPT_CHARS, SegmentCache
from ferry.shared.eos import eos_token_ids
from ferry.shared.errors import InvalidRequest, ModelLoadError


class TooLong(InvalidRequest):
    """A prompt refused by its length in characters, before it was tokenized."""


class PromptTokenizer:
    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer

            self.hf: Any = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - any failure here means: no usable tokenizer at that path
            raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
        self.eos_token_ids = eos_token_ids(path if Path(path).is_dir() else None, self.hf)
        self.vocab_size = len(self.hf)
        # The most characters one token can stand for (byte-level vocabularies spell a token with one
        # character per byte, so this bounds the decoded text too): a text longer than
        # max_model_len x this cannot fit the model, whatever it tokenizes to.
        self.longest_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1) or 1
        self.max_model_len: int | None = None  # set from the scheduler's status (routes); None: unchecked
        # long prompts are tokenized segment by segment, the segments sent before looked up (segment_cache.py)
        self.segments = SegmentCache.for_tokenizer(self.hf)

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
            raise TooLong(f"the prompt is {n} characters but the model length is {length} tokens, and no token of "
                          f"this model stands for more than {self.longest_token_chars} characters: it cannot fit; "
                          "shorten the prompt")  # fmt: skip

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.encode(self.chat_text(messages))

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None, continue_final: bool = False,
                  **template_kwargs) -> str:  # fmt: skip
        """The rendered prompt. `tools` go to the template (apply_chat_template(tools=...)), which
        writes them the way the model was trained to read them; `continue_final` continues the last
        (assistant) message instead of opening a new turn; other keywords are template variables
        (Qwen3's `enable_thinking`)."""
        if not self.hf.chat_template:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        try:
            return self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=not continue_final,
                                               continue_final_message=continue_final, tokenize=False,
                                               **template_kwargs)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the client's to fix
            raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc

    def encode(self, text: str) -> list[int]:
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
