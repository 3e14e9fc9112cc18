"""Sampling parameters of one request, as they cross from the api to the worker, and their rules. No torch.

The rules (`sampling_problems`) are checked once, where a request is built (the api's schema,
`ferry generate`), so a request that reaches the worker has parameters the sampler can use: one
request's bad values never fail the step it is batched in. How many tokens a request may produce
is not a sampling parameter: it travels as `Submit.max_tokens` and the scheduler stops the request.
"""

from __future__ import annotations

import msgspec

from ferry.shared.bounds import Int64

MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs (chat) and logprobs (completions)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's limit)
MAX_GRAMMAR_CHARS = 16 * 2**20  # a grammar's length: several times what a default 4 MiB body's schema compiles to


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
    # What a request may ask beyond sampling proper; each default asks nothing, and a request that asks
    # nothing takes the sampler's plain path (no extra work on the device, no wait for it). Integers are
    # Int64 on the wire like the others; their ranges (and logit_bias's token ids against the
    # vocabulary: shared/contract.py) are the rules below.
    logit_bias: tuple[tuple[Int64, float], ...] = ()  # (token id, bias added to its logit), OpenAI's -100..100
    logprobs: Int64 | None = None  # the sampled tokens' log-probabilities, with this many top alternatives (0..20)
    prompt_logprobs: Int64 | None = None  # the prompt tokens' log-probabilities (completions' echo), top alternatives
    grammar: str | None = None  # llguidance grammar (JSON) the output must match: structured outputs, forced tool calls

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def reads_its_output(self) -> bool:
        """Whether drawing a token reads the request's earlier output on the worker's host (penalty
        counts, a grammar's matcher): such a request's next step waits for its last token to come
        back, and is never scheduled ahead (shared/step.py, `feed_sampled`)."""
        return (
            self.grammar is not None
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


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
        (len(p.logit_bias) <= MAX_LOGIT_BIAS, f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(p.logit_bias)}"),
        (all(-100 <= b <= 100 for _, b in p.logit_bias), "logit_bias values must be in [-100, 100]"),
        (all(t >= 0 for t, _ in p.logit_bias), "logit_bias keys must be token ids (>= 0)"),
        (
            p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS,
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {p.logprobs}",
        ),
        (
            p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {p.prompt_logprobs}",
        ),
        (
            p.grammar is None or len(p.grammar) <= MAX_GRAMMAR_CHARS,
            f"the grammar (response_format or a forced tool call) is {len(p.grammar or '')} characters; "
            f"at most {MAX_GRAMMAR_CHARS}",
        ),
    ]
    return [message for ok, message in rules if not ok]
