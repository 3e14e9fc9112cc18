"""Sampling parameters of one request, as they cross from the api to the worker. No torch."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI / vLLM semantics. temperature 0 means greedy; top_k 0 (or -1) and top_p 1 disable those
    filters; min_p 0 disables; penalties at their neutral values (1.0 / 0.0) do nothing.

    repetition_penalty follows transformers/vLLM (divides positive logits of every token seen in
    prompt or output, multiplies negative ones); presence and frequency penalties follow OpenAI and
    count output tokens only. seed makes the request's samples reproducible on its own."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0
