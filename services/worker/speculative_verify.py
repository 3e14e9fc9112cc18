"""Speculative decoding's verify rule: which of a row's drafts the target model keeps, and the token it adds
(shared/speculation.py says what a drafting row is). Vectorised over every position of the step's drafting
rows, on the device, with no wait for it.

At each position of a row the target distribution p is what the sampler would draw from there (logit_bias,
then temperature and top-k / top-p / min-p, sampler.py's order; requests with penalties or a grammar never
draft). The drafts are deterministic (prompt lookup), so the draft distribution is one-hot and the standard
speculative sampling rule (Leviathan et al., Chen et al.) reads:

* sampled rows: draft x is kept with probability p(x); at the first one refused, the row's token is drawn
  from p with x removed, renormalised; with every draft kept, the bonus token is drawn from p at the last
  position. Each token then has exactly p's distribution given the ones before it, as without speculation;
* greedy rows: a draft is kept while it is the target's argmax; the row's token is the argmax where the first
  one was not (or after the last), so the tokens are those decoding one at a time would give, as long as the
  verify's logits are.

Draws come from the worker's generator: uniforms for the acceptances and, for the tokens, the exponential race
of kernels/sample_rows.py (seeded requests never draft: their noise stays their own, draw for draw)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ferry.kernels.host_to_device import to_device
from ferry.kernels.sample_rows import sample_rows
from ferry.services.worker.sampler import RequestSamplingState, apply_logit_bias, filter_logits, needs_filter


def accepts(uniform: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """Whether a sampled position keeps its draft: with probability p(draft), the rule that keeps the target
    distribution exact for a one-hot draft distribution (min(1, p / q) with q = 1)."""
    return uniform < p_draft


def verify_drafts(
    states: Sequence[RequestSamplingState],
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    generator: torch.Generator,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For R drafting rows (row i: `states[i]`'s request, `drafts[i]` its d_i drafts; `logits` [sum(d_i + 1), V]
    the target's logits at the row's positions, in order): (the token each row adds int64 [R], its
    log-probability under p float32 [R], how many drafts each row keeps int32 [R]), on the device."""
    device = logits.device
    spans = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
    starts = np.cumsum(spans) - spans
    row_of = np.repeat(np.arange(len(drafts)), spans)
    positions = [states[i] for i in row_of.tolist()]
    params = [s.params for s in positions]
    # each position's draft, the one it is asked to keep; -1 at a row's last position (the bonus)
    draft_at = np.concatenate([np.append(np.asarray(d, dtype=np.int64), -1) for d in drafts])

    scaled = apply_logit_bias(logits.to(torch.float32), positions, vocab_size)
    inv_t = [1.0 if p.greedy else 1.0 / p.temperature for p in params]
    scaled = scaled * to_device(inv_t, torch.float32, device)[:, None]
    filtering = [j for j, p in enumerate(params) if not p.greedy and needs_filter(p, vocab_size)]
    if filtering:
        rows = to_device(filtering, torch.int64, device)
        scaled[rows] = filter_logits(scaled[rows], [params[j] for j in filtering])
    log_p = torch.log_softmax(scaled, dim=-1)

    n = len(params)
    has_draft = to_device(draft_at >= 0, torch.bool, device)
    draft = to_device(np.maximum(draft_at, 0), torch.int64, device)
    greedy = to_device([p.greedy for p in params], torch.bool, device)
    # the token a position gives where the row stops: greedy, the argmax; sampled, a draw from p without the
    # position's draft (none at the last position: the bonus, from p itself)
    remove = np.flatnonzero((draft_at >= 0) & ~np.array([p.greedy for p in params], dtype=bool))
    race = scaled.clone()
    if remove.size:  # positions and draft ids known on the host: no wait for the device
        race[to_device(remove, torch.int64, device), to_device(draft_at[remove], torch.int64, device)] = float("-inf")
    noise = torch.empty(n, vocab_size, dtype=torch.float32, device=device).exponential_(generator=generator)
    noise_rows = torch.where(greedy, -1, torch.arange(n, device=device))
    choice, _ = sample_rows(race, torch.ones(n, dtype=torch.float32, device=device), noise, noise_rows)
    uniform = torch.rand(n, generator=generator, device=device)
    p_draft = log_p.gather(1, draft[:, None]).squeeze(1).exp()
    # where p leaves nothing beside the draft (p(draft) = 1 but for rounding) the draft is kept: there is no
    # other token to draw
    nothing_else = ~torch.isfinite(race).any(dim=-1)
    keep = torch.where(greedy, choice == draft, accepts(uniform, p_draft) | nothing_else) & has_draft

    # drafts kept: the leading run of kept positions of each row
    width = int(spans.max()) - 1
    index = starts[:, None] + np.arange(max(width, 1))[None, :]
    valid = np.arange(max(width, 1))[None, :] < (spans - 1)[:, None]
    kept_matrix = keep[to_device(np.where(valid, index, 0), torch.int64, device)] & to_device(valid, torch.bool, device)
    accepted = kept_matrix.to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.int32)
    final = to_device(starts, torch.int64, device) + accepted.to(torch.int64)
    tokens = choice[final]
    logprobs = log_p[final].gather(1, tokens[:, None]).squeeze(1)
    return tokens, logprobs, accepted
