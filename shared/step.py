"""The contract between the scheduler and the worker: one step of the model over a batch.

The scheduler owns every page and slot; the worker only reads the indices it is given. Arrays
are numpy so they can cross the wire as zero-copy frames (shared/wire.py); the executor turns
them into device tensors. No torch here.

Index conventions (shared by the planner, the pools and the allocators):
* KV pool: physical page 0 is the sentinel page, never allocated; usable pages are 1..pages.
  Unused entries of `page_table` hold 0, so padded positions write only the sentinel.
* Linear-state pool: slot 0 is the padding slot; usable slots are 1..slots. Models without
  linear attention ignore `state_slots`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ferry.shared.sampling import SamplingParams

SENTINEL_PAGE = 0
PADDING_STATE_SLOT = 0


@dataclass
class NewRequest:
    """Sent once, with a request's first chunk: what the sampler keeps for the request's lifetime."""

    req_id: int
    prompt_token_ids: np.ndarray  # int32 [P], for repetition penalty
    sampling: SamplingParams


@dataclass
class StepBatch:
    """One forward step over R requests and T = sum(query_lens) new tokens.

    Request i contributes tokens[qs[i]:qs[i]+query_lens[i]] (qs = exclusive cumsum of query_lens)
    at positions context_lens[i] .. context_lens[i]+query_lens[i]-1; its K/V before this step are
    in its pages; its K/V for the new tokens are written to the same pages at those positions.
    """

    step_id: int
    req_ids: np.ndarray  # int64 [R]
    tokens: np.ndarray  # int32 [T]
    query_lens: np.ndarray  # int32 [R], >= 1
    context_lens: np.ndarray  # int32 [R], tokens already in KV (cached prefix or earlier chunks)
    page_table: np.ndarray  # int32 [R, max_pages], page ids; 0 (sentinel) past the end
    state_slots: np.ndarray  # int32 [R], linear-state slot (0 = padding slot / unused)
    reset_state: np.ndarray  # bool [R], zero the linear state before this chunk (a request's first chunk)
    sample: np.ndarray  # bool [R], sample a next token after this chunk (last prefill chunk, or decode)
    new_requests: list[NewRequest] = field(default_factory=list)
    finished_req_ids: list[int] = field(default_factory=list)  # forget sampler state of these, before the step


@dataclass
class StepOutput:
    """What one step produced: a token for each request whose `sample` flag was set, in batch order."""

    step_id: int
    req_ids: np.ndarray  # int64 [S]
    token_ids: np.ndarray  # int32 [S]
    logprobs: np.ndarray  # float32 [S], log-probability of the sampled token under the sampling distribution
