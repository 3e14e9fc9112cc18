"""Sampling parameters of one request, as they cross from the api to the worker, and their rules. No torch.

The rules (`sampling_problems`) are checked once, where a request is built (the api's schema,
`ferry generate`), so a request that reaches the worker has parameters the sampler can use: one
request's bad values never fail the step it is batched in. How many tokens a request may produce
is not a sampling parameter: it travels as `Submit.max_tokens` and the scheduler stops the request.
"""

from __future__ import annotations

import msgspec

from ferry.shared.bounds import Int64


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI / vLLM semantics. temperature 0 means greedy; top_k 0 (or -1) and top_p 1 disable those
    filters; min_p 0 disables; penalties at their neutral values (1.0 / 0.0) do nothing.

    repetition_penalty follows transformers/vLLM (divides positive logits of every token seen in
    prompt or output, multiplies negative ones); presence and frequency penalties follow OpenAI and
    count output tokens only. seed makes the request's samples reproducible on its own."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = 0
    min_p: float = 0.0
    seed: Int64 | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: tuple[Int64, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sampling_problems(p: SamplingParams) -> list[str]:
    """What is wrong with `p`, one message per field, each naming the field ([] when nothing is)."""
    rules = [
        (p.temperature >= 0, f"temperature must be >= 0, got {p.temperature}"),
        (0 < p.top_p <= 1, f"top_p must be in (0, 1], got {p.top_p}"),
        (p.top_k >= -1, f"top_k must be -1, 0 (both: disabled) or positive, got {p.top_k}"),
        (0 <= p.min_p <= 1, f"min_p must be in [0, 1], got {p.min_p}"),
        (p.repetition_penalty > 0, f"repetition_penalty must be > 0, got {p.repetition_penalty}"),
        (-2 <= p.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (-2 <= p.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
    ]
    return [message for ok, message in rules if not ok]
