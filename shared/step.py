"""The contract between the scheduler and the worker: one step of the model over a batch.

The scheduler owns every page and slot; the worker only reads the indices it is given. Arrays
are numpy so they can cross the wire as typed buffers (shared/wire.py); the executor turns them
into device tensors. The structs are frozen and built by keyword; the arrays in them are not
copied (shared/wire.py says how those decoded from the wire hold their bytes). No torch here.

Index conventions (shared by the planner, the pools and the allocators; docs/ARCHITECTURE.md,
"The memory planner"):
* KV pool: physical page 0 is the sentinel page, never allocated; usable pages are 1..pages.
  Unused entries of `page_table` hold 0, so padded positions write only the sentinel.
* Linear-state pool: slot 0 is the padding slot; usable slots are 1..slots. Models without
  linear attention ignore `linear_state_slots`, unless their sliding KV groups keep rings
  (plan/kv_groups.py): a request's slot is then also its rings' (ring 0 the padding rows').
* Linear-state snapshots (hybrid models' prefix cache): ids 0..snapshots-1, in a pool of their own; no
  batch row reads or writes one, only the step's state copies (`restore_state`, `save_state`), and -1
  means none.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ferry.shared.bounds import Count32, Id
from ferry.shared.sampling import SamplingParams


class NewRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Sent once, with a request's first chunk: what the sampler keeps for the request's lifetime."""

    req_id: Id
    prompt_token_ids: np.ndarray  # int32 [P], for repetition penalty
    sampling: SamplingParams


class StepBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One forward step over R requests and T = sum(query_lens) new tokens.

    Request i contributes tokens[qs[i]:qs[i]+query_lens[i]] (qs = exclusive cumsum of query_lens)
    at positions context_lens[i] .. context_lens[i]+query_lens[i]-1; its K/V before this step are
    in its pages; its K/V for the new tokens are written to the same pages at those positions.
    """

    step_id: Id
    req_ids: np.ndarray  # int64 [R]
    tokens: np.ndarray  # int32 [T]
    query_lens: np.ndarray  # int32 [R], >= 1
    context_lens: np.ndarray  # int32 [R], tokens already in KV (cached prefix or earlier chunks)
    page_table: np.ndarray  # int32 [R, max_pages], page ids; 0 (sentinel) past the end
    linear_state_slots: np.ndarray  # int32 [R], linear-state (and KV ring) slot (0 = padding slot / unused)
    reset_linear_state: np.ndarray  # bool [R], zero the linear state before this chunk (a request's first chunk)
    sample: np.ndarray  # bool [R], sample a next token after this chunk (last prefill chunk, or decode)
    new_requests: tuple[NewRequest, ...] = ()
    finished_req_ids: tuple[Id, ...] = ()  # forget sampler state of these, before the step
    # bool [R]: give the log-probabilities of this chunk's next tokens (prompt logprobs; None: no row asks).
    # A step with such a row runs eagerly: it needs the logits of more rows than the ones that sample.
    prompt_logprobs: np.ndarray | None = None
    # bool [R]: the row's one token is the one this request sampled in the step just before, which the
    # scheduler sent before that step's answer came back (its entry in `tokens` is a placeholder, 0).
    # The worker takes it from that step's sampled tokens on the device. None: no such row.
    feed_sampled: np.ndarray | None = None
    # Linear-state copies (hybrid models' prefix cache, docs/ARCHITECTURE.md §1 "Prefix cache"), int32 [R]
    # snapshot ids, -1 for none; None: no row copies. `restore_state`: before the forward, the row's slot
    # takes that snapshot's state (a request starting from a cached prefix: its context_lens is the
    # snapshot's position and reset_linear_state is False). `save_state`: after the forward, that snapshot
    # takes the row's state (the state at the end of this chunk, context_lens + query_lens). Restores run
    # before saves, so a snapshot may be read by one row and rewritten by another in the same step.
    restore_state: np.ndarray | None = None
    save_state: np.ndarray | None = None
    # int32 [R]: where in its chunk a saving row's state is kept, in tokens of the row (1..query_lens); None,
    # or a row's query_lens: at its end, after the forward. A row saved inside its chunk (a prompt's
    # snapshot point that is not its chunk's end) is saved by the linear layers during the forward, so
    # the prompt is not cut into one more step (with experts offloaded, one more pass over the misses).
    save_offset: np.ndarray | None = None
    # int32 [R]: speculative decoding (shared/speculation.py). A row's last draft_lens[i] tokens are drafts: the
    # row samples at each of its last draft_lens[i] + 1 positions, keeps the drafts the target agrees with and
    # adds one token of its own (StepOutput.accepted_drafts). Such a row samples, saves no state, is not fed,
    # and its request may speculate (speculation.speculates). None: no row drafts.
    draft_lens: np.ndarray | None = None
    # int32 [R] snapshot ids, -1 for none: a hybrid model's drafting rows. The snapshot takes the row's linear
    # state before the forward (after the restores), and a row that refused a draft takes it back after the
    # verify (speculation.computed_after_verify). Every hybrid drafting row holds one. None: no row holds.
    hold_state: np.ndarray | None = None
    # --speculative-method mtp (services/worker/mtp_drafts.py): the worker writes the MTP layer's K/V of every row
    # after the forward. int32 [R]: drafts to chain after a sampling row, from its last real position (0: none; the
    # request's pages hold the chain's K/V). None: no row asks.
    mtp_drafts: np.ndarray | None = None
    # int32 [R]: the token after a row's chunk where the row does not sample (a prompt's chunk before its last),
    # the MTP layer's input at the chunk's last position; -1: not known (that position is left to the next chunk
    # of the row... never: the scheduler knows a prompt's tokens). None: no such row.
    next_tokens: np.ndarray | None = None

    def saved_inside(self) -> np.ndarray:
        """bool [R]: the rows whose state is saved inside their chunk (by the linear layers, during the
        forward); the other saving rows save at their chunk's end, after it."""
        if self.save_state is None or self.save_offset is None:
            return np.zeros(len(self.req_ids), dtype=bool)
        return (self.save_state >= 0) & (self.save_offset < self.query_lens)

    @classmethod
    def empty(cls, step_id: int, finished_req_ids: tuple[int, ...] = ()) -> "StepBatch":
        """A step of no requests: it only makes the worker forget `finished_req_ids` (and, all padding,
        it is what the decode graphs are captured on)."""
        return cls(
            step_id=step_id,
            req_ids=np.zeros(0, np.int64),
            tokens=np.zeros(0, np.int32),
            query_lens=np.zeros(0, np.int32),
            context_lens=np.zeros(0, np.int32),
            page_table=np.zeros((0, 1), np.int32),
            linear_state_slots=np.zeros(0, np.int32),
            reset_linear_state=np.zeros(0, bool),
            sample=np.zeros(0, bool),
            finished_req_ids=tuple(finished_req_ids),
        )


class Logprobs(msgspec.Struct, frozen=True, kw_only=True):
    """Log-probabilities of a run of consecutive tokens of one request under the model's own distribution
    (the log-softmax of its logits, before penalties, biases, grammar masks, temperature and filters), with
    the k most likely tokens at each position, most likely first. `start` is the position, in the request's
    sequence (prompt then output), of the first token described."""

    req_id: Id
    start: Count32  # a position: below max_model_len, which an int32 holds
    token_logprobs: np.ndarray  # float32 [n]
    top_ids: np.ndarray  # int32 [n, k]
    top_logprobs: np.ndarray  # float32 [n, k], descending


class StepOutput(msgspec.Struct, frozen=True, kw_only=True):
    """What one step produced: a token for each request whose `sample` flag was set, in batch order."""

    step_id: Id
    req_ids: np.ndarray  # int64 [S]
    token_ids: np.ndarray  # int32 [S]
    logprobs: np.ndarray  # float32 [S], log-probability of the sampled token under the sampling distribution
    sampled_logprobs: tuple[Logprobs, ...] = ()  # the sampled token, for each request whose `logprobs` is set
    prompt_logprobs: tuple[Logprobs, ...] = ()  # the rows StepBatch.prompt_logprobs asked for, per request
    # (req_id, why) of the requests whose grammar allows no way on (its matcher died: a parser limit, a schema
    # no finite value matches): they fail instead of taking their sampled token, the end of sequence
    grammar_failures: tuple[tuple[Id, str], ...] = ()
    # int32 [S]: for each request that sampled, how many of its row's drafts (StepBatch.draft_lens) were kept;
    # its tokens this step are those drafts and then token_ids[i] (the logprobs entry is that last token's).
    # None: no row drafted.
    accepted_drafts: np.ndarray | None = None
    # int32 [S, K]: the MTP layer's drafts for each request that sampled, after its last token this step
    # (StepBatch.mtp_drafts of them; -1 past those). None: no row asked for any.
    mtp_drafts: np.ndarray | None = None
    # what the step cost on the device, for speculative decoding's draft-length controller (0: not measured, e.g.
    # off CUDA): a decode graph's replay, seconds; the MTP chain's seconds a chain position; a step that verified
    # drafts, its forward and verify, seconds (a verify graph's replay where the worker has them: 0 for a step that
    # ran eagerly beside them)
    decode_step_s: float = 0.0
    chain_position_s: float = 0.0
    verify_step_s: float = 0.0
