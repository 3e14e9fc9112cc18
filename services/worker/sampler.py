"""Next-token sampling for a batch of requests, each with its own parameters and history.

Per-request state lives from the request's `NewRequest` until its id appears in
`finished_req_ids`. Each step's sampling is vectorised over the rows that sample:

  logits -> repetition penalty (prompt + output tokens; transformers/vLLM semantics)
         -> presence and frequency penalties (output tokens; OpenAI semantics)
         -> logit_bias (OpenAI), then the grammar's mask (structured outputs: grammar.py)
         -> greedy rows: argmax
         -> other rows: / temperature -> top-k -> top-p -> min-p -> draw

Draws use the exponential race (argmax p / q with q ~ Exp(1), computed as argmax s - log q over the
scaled logits s: kernels/sample_rows.py), so a seeded request draws its noise from its own
torch.Generator and its tokens do not depend on what it is batched with. The logprob returned is that of the chosen
token under the distribution it was drawn from: after penalties, temperature and filters for sampled rows, after
penalties (at temperature 1) for greedy rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ferry.kernels.host_to_device import to_device
from ferry.kernels.sample_rows import sample_rows
from ferry.services.worker.grammar import GrammarSet, failure
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import NewRequest


@dataclass
class RequestSamplingState:
    """What one request's sampling remembers. Penalty tables exist only for requests that use
    penalties, and are updated by one element per token, so a step's cost does not grow with
    the length of a request's output."""

    params: SamplingParams
    generator: torch.Generator | None = None  # only for requests with a seed
    output_token_ids: list[int] = field(default_factory=list)
    output_counts: torch.Tensor | None = None  # float32 [V]: presence/frequency/repetition penalties
    seen: torch.Tensor | None = None  # bool [V], prompt and output tokens: repetition penalty
    known_tokens: np.ndarray | None = None  # the sequence as announced (prompt, and output before a preemption)
    matcher: object | None = None  # llguidance matcher, for a request with a grammar
    # temperature is all its drawing needs (no penalty, logit_bias, grammar, filter or logprobs): a decode
    # graph's own sampling serves it (decode_graphs.py)
    plain: bool = False

    @classmethod
    def create(
        cls, new: NewRequest, vocab_size: int, device: torch.device, grammars: GrammarSet | None = None
    ) -> "RequestSamplingState":
        p = new.sampling
        generator = None
        if p.seed is not None:
            generator = torch.Generator(device=device).manual_seed(int(p.seed) & (2**63 - 1))
        plain = (
            not p.reads_its_output
            and not p.logit_bias
            and p.logprobs is None
            and (p.greedy or not needs_filter(p, vocab_size))
        )
        state = cls(p, generator, known_tokens=new.prompt_token_ids, plain=plain)
        if p.grammar is not None and grammars is not None:
            state.matcher = grammars.matcher(p.grammar)
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            state.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if p.repetition_penalty != 1.0:
            prompt = torch.as_tensor(new.prompt_token_ids, dtype=torch.int64).to(device)
            state.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            state.seen[prompt[(prompt >= 0) & (prompt < vocab_size)]] = True
        return state

    def token_at(self, position: int) -> int | None:
        """The token at `position` of the request's sequence, if this worker has seen it."""
        known = len(self.known_tokens) if self.known_tokens is not None else 0
        if position < known:
            return int(self.known_tokens[position])
        position -= known
        return self.output_token_ids[position] if position < len(self.output_token_ids) else None

    def record(self, token: int) -> None:
        if self.matcher is not None:
            self.matcher.consume_token(token)  # a token the mask did not allow leaves it in its error state
        self.output_token_ids.append(token)
        if self.output_counts is not None:
            self.output_counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str, seed: int | None = None, grammar_tokenizer=None):
        """`grammar_tokenizer`: builds the llguidance tokenizer (grammar.tokenizer_factory), needed only
        by requests with a grammar."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.requests: dict[int, RequestSamplingState] = {}
        self.grammars = GrammarSet(grammar_tokenizer, vocab_size, self.device)
        # Noise for unseeded requests: one generator for the whole worker.
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    @property
    def generator(self) -> torch.Generator:
        """The worker's generator, the noise of every unseeded request (speculative_verify.py draws from it)."""
        return self._generator

    # ---- request lifetime ------------------------------------------------------------
    def add_request(self, new: NewRequest) -> None:
        """Register a request (replacing any earlier state under the same id). Its parameters were
        checked where the request was built (shared/sampling.py's `sampling_problems`)."""
        self.requests[new.req_id] = RequestSamplingState.create(new, self.vocab_size, self.device, self.grammars)

    def remove_request(self, req_id: int) -> None:
        self.requests.pop(req_id, None)

    # ---- one step ----------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, req_ids: Sequence[int], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row of `logits` ([S, V], row i belongs to req_ids[i]); record it.

        Returns (token ids int64 [S], logprobs float32 [S]) on the sampling device."""
        tokens, logprobs = self.choose(req_ids, logits)
        self.record(req_ids, tokens.tolist())
        return tokens, logprobs

    @torch.no_grad()
    def choose(self, req_ids: Sequence[int], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`sample` without recording and without waiting for the device: every decision about
        which rows need what is made from the requests' parameters on the host, and the tokens
        stay on the device. The caller brings them to the host and then calls `record`."""
        if logits.shape[0] != len(req_ids):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(req_ids)} requests")
        try:
            states = [self.requests[int(r)] for r in req_ids]
        except KeyError as exc:
            raise KeyError(f"request {exc.args[0]} was never registered with the sampler (no NewRequest)") from None
        logits = logits.to(device=self.device, dtype=torch.float32)
        if not states:
            empty = torch.empty(0, device=self.device)
            return empty.long(), empty
        logits = apply_penalties(logits, states, self.vocab_size)
        logits = apply_logit_bias(logits, states, self.vocab_size)
        logits = self._apply_grammars(logits, states)
        return self._choose(logits, states)

    def _apply_grammars(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> torch.Tensor:
        rows = [i for i, s in enumerate(states) if s.matcher is not None]
        if not rows:
            return logits
        masks = self.grammars.masks([states[i].matcher for i in rows])
        if len(rows) == len(states):
            return self.grammars.apply(logits, masks)
        index = to_device(rows, torch.int64, self.device)
        logits = logits.clone()
        logits[index] = self.grammars.apply(logits[index], masks)
        return logits

    @torch.no_grad()
    def top_logprobs(self, req_ids: Sequence[int], logits: torch.Tensor, tokens: torch.Tensor):
        """For the rows whose request asks for `logprobs`: (row indices, the sampled tokens' log-probabilities
        [m], the top-k token ids [m, k] and log-probabilities [m, k], k the most any of them asks), under the
        model's own distribution (`logits` as the model gave them); None when no row asks (nothing runs)."""
        states = [self.requests[int(r)] for r in req_ids]
        rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not rows:
            return None
        k = max(states[i].params.logprobs for i in rows)
        index = to_device(rows, torch.int64, self.device) if len(rows) < len(states) else None
        raw = logits.to(device=self.device, dtype=torch.float32)
        chosen = tokens
        if index is not None:
            raw, chosen = raw[index], tokens[index]
        token_lps, top_ids, top_lps = log_softmax_top(raw, chosen, k)
        return rows, token_lps, top_ids, top_lps

    def record(self, req_ids: Sequence[int], tokens: Sequence[int]) -> None:
        """The tokens `choose` drew, now on the host: each request's history and penalty counts."""
        for req_id, token in zip(req_ids, tokens):
            self.requests[int(req_id)].record(int(token))

    def grammar_failures(self, req_ids: Sequence[int]) -> tuple[tuple[int, str], ...]:
        """(req_id, why) of those of `req_ids` whose grammar's matcher is dead (after `record`): the
        token they drew was only the end of sequence its mask falls back to, not a complete output."""
        states = ((int(r), self.requests[int(r)].matcher) for r in req_ids)
        return tuple((r, why) for r, m in states if m is not None and (why := failure(m)) is not None)

    def _choose(self, logits: torch.Tensor, states: list[RequestSamplingState]) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy rows take the argmax, sampled ones race their noise (kernels/sample_rows.py), in one
        pass over the vocabulary; rows that filter (top-k, top-p, min-p) are filtered first."""
        params = [s.params for s in states]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        inv_t = [1.0 if p.greedy else 1.0 / p.temperature for p in params]
        filtering = [i for i in sampled if needs_filter(params[i], self.vocab_size)]
        if filtering:
            rows = to_device(filtering, torch.int64, self.device)
            logits = logits.clone()
            logits[rows] = filter_logits(
                logits[rows] * to_device([inv_t[i] for i in filtering], torch.float32, self.device)[:, None],
                [params[i] for i in filtering],
            )
            for i in filtering:  # already scaled
                inv_t[i] = 1.0
        noise = None
        noise_rows = [-1] * len(params)
        if sampled:
            noise = self._exponential_noise(len(sampled), [states[i] for i in sampled])
            for j, i in enumerate(sampled):
                noise_rows[i] = j
        return sample_rows(
            logits, to_device(inv_t, torch.float32, self.device), noise, to_device(noise_rows, torch.int64, self.device)
        )

    @torch.no_grad()
    def graph_sampling(self, req_ids: Sequence[int], noise: torch.Tensor) -> tuple[list[float], list[int]] | None:
        """For a decode graph that samples its rows itself (decode_graphs.py): (each row's inverse
        temperature, its row of `noise`, -1 for greedy), with the noise drawn into `noise`'s first rows
        as `choose` draws it (a seeded request from its own generator, so its tokens are the same either
        way); None when a row needs more than its temperature, and `choose` must run on the logits."""
        states = [self.requests[int(r)] for r in req_ids]
        if not all(s.plain for s in states):
            return None
        sampled = [i for i, s in enumerate(states) if not s.params.greedy]
        if sampled:
            rows = noise[: len(states)]
            if any(states[i].generator is None for i in sampled):
                rows.exponential_(generator=self._generator)
            for i in sampled:
                if states[i].generator is not None:
                    rows[i].exponential_(generator=states[i].generator)
        inv_t = [1.0 if s.params.greedy else 1.0 / s.params.temperature for s in states]
        return inv_t, [-1 if s.params.greedy else i for i, s in enumerate(states)]

    def _exponential_noise(self, rows: int, states: list[RequestSamplingState]) -> torch.Tensor:
        noise = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=self.device)
        noise.exponential_(generator=self._generator)
        for i, state in enumerate(states):
            if state.generator is not None:
                noise[i].exponential_(generator=state.generator)
        return noise  # an exact 0 draw is taken as the smallest normal float by sample_rows


def log_softmax_top(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """(log-probability of each row's target [n], top-k ids int32 [n, k], top-k log-probabilities [n, k]),
    from one log-softmax, so a target that is the most likely token has exactly the top entry's value."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets.long()[:, None]).squeeze(1)
    top = lp.topk(k, dim=-1) if k > 0 else None
    if top is None:
        empty = torch.empty((lp.shape[0], 0), device=lp.device)
        return chosen, empty.int(), empty
    return chosen, top.indices.int(), top.values


def apply_logit_bias(logits: torch.Tensor, states: list[RequestSamplingState], vocab_size: int) -> torch.Tensor:
    """OpenAI's logit_bias: each (token, bias) of a row's request added to that row's logit."""
    if not any(s.params.logit_bias for s in states):
        return logits
    rows, cols, values = [], [], []
    for i, s in enumerate(states):
        for token, bias in s.params.logit_bias:
            if 0 <= token < vocab_size:
                rows.append(i)
                cols.append(token)
                values.append(bias)
    if not rows:
        return logits
    device = logits.device
    index = (to_device(rows, torch.int64, device), to_device(cols, torch.int64, device))
    return logits.index_put(index, to_device(values, torch.float32, device), accumulate=True)


def apply_penalties(logits: torch.Tensor, states: list[RequestSamplingState], vocab_size: int) -> torch.Tensor:
    """Repetition (over prompt + output), then presence and frequency (over output) penalties."""
    params = [s.params for s in states]
    needs_repetition = any(p.repetition_penalty != 1.0 for p in params)
    needs_openai = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
    if not (needs_repetition or needs_openai):
        return logits
    device = logits.device
    logits = logits.clone()
    if needs_repetition:
        unseen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        seen = torch.stack([s.seen if s.seen is not None else unseen for s in states])
        penalty = to_device([p.repetition_penalty for p in params], torch.float32, device)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if needs_openai:
        none = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        counts = torch.stack([s.output_counts if s.output_counts is not None else none for s in states])
        presence = to_device([p.presence_penalty for p in params], torch.float32, device)[:, None]
        frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)[:, None]
        logits = logits - frequency * counts - presence * (counts > 0).float()
    return logits


def needs_filter(p: SamplingParams, vocab: int) -> bool:
    """Whether a sampled row's top-k, top-p or min-p removes any token (`filter_logits` would run)."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p, then min-p, as -inf masks over temperature-scaled logits [S, V].

    Each filter keeps at least the most likely token. Top-p keeps the smallest prefix of the
    sorted distribution (after top-k) whose mass reaches p; min-p keeps tokens whose probability
    is at least min_p times the most likely token's."""
    vocab = logits.shape[-1]
    device = logits.device
    k_values = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # which filters run is decided from the parameters on the host: no wait for the device
    if any(k < vocab for k in k_values) or any(p.top_p < 1.0 for p in params):
        top_k = to_device(k_values, torch.int64, device)
        top_p = to_device([p.top_p for p in params], torch.float32, device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (mass_before >= top_p[:, None]) & (rank > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, device)
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
