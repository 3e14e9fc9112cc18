"""The model's tokenizer and chat template, through transformers' AutoTokenizer (no torch needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferry.shared.eos import eos_token_ids
from ferry.shared.errors import InvalidRequest, ModelLoadError


class PromptTokenizer:
    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer

            self.hf: Any = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001 - any failure here means: no usable tokenizer at that path
            raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
        self.eos_token_ids = eos_token_ids(path if Path(path).is_dir() else None, self.hf)
        self.vocab_size = len(self.hf)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if not self.hf.chat_template:
            raise InvalidRequest("this model has no chat template; use /v1/completions")
        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the client's to fix
            raise InvalidRequest(f"the chat template rejected these messages: {exc}") from exc
        return self.hf.encode(text, add_special_tokens=False)

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.hf.encode(prompt, add_special_tokens=False)
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return prompt
