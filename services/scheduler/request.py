"""One request as the scheduler tracks it, from admission to finish."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.services.scheduler.ngram_proposer import TokenArray
from ferry.services.scheduler.radix_cache import Node
from ferry.services.scheduler.state_snapshots import Snapshot
from ferry.shared.errors import FerryError
from ferry.shared.sampling import SamplingParams


@dataclass(eq=False)
class Request:
    rid: int  # scheduler-wide id; the worker's req_id
    client: bytes  # the api replica's identity
    client_req_id: int  # the id that replica gave it
    prompt_len: int
    sampling: SamplingParams
    max_tokens: int  # resolved at admission: the request stops with "length" after this many tokens
    tokens: list[int]  # prompt + output so far: what the KV must hold, and the key for the prefix cache
    output_len: int = 0
    pages: list[int] = field(default_factory=list)  # KV pages, in sequence order
    nodes: list[Node] = field(default_factory=list)  # prefix-cache nodes held; nodes[i].page == pages[i]
    num_computed: int = 0  # tokens whose K/V are in `pages`
    linear_state_slot: int = 0  # hybrid models; 0: none (the padding slot)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache at first admission
    admitted_once: bool = False
    announced: bool = False  # the worker holds sampler state for it (NewRequest sent)
    abort_pending: bool = False  # aborted while in a step in flight: finish when that step returns
    abort_error: FerryError | None = None  # the server aborted it (not its replica): it ends as this failure
    in_flight: int = 0  # steps in flight that hold a row of it (two when the second was scheduled ahead)
    done: bool = False  # finished, failed or aborted; its pages wait for in_flight to reach 0
    prompt_logprobs_done: int = 0  # prompt positions 1..this have had their log-probabilities sent
    # hybrid models' prefix cache (batcher.py, state_snapshots.py):
    restore_from: int = -1  # the snapshot its slot takes in the next step (admitted from a cached prefix)
    rolling: Snapshot | None = None  # its last snapshot inside its output, replaced by the next one
    snapshot_points: set[int] = field(default_factory=set)  # page boundaries its prefill chunks end on
    shared_pages: dict[int, int] = field(default_factory=dict)  # rid -> full pages its tokens share with that request's
    token_array: TokenArray = field(default_factory=TokenArray)  # `tokens` as an array, for prompt lookup's drafts
    # --speculative-method mtp: the worker's drafts after the request's first `mtp_drafts_at` tokens (StepOutput.
    # mtp_drafts), drafts for its next row while its tokens are still that many
    mtp_drafts: tuple[int, ...] = ()
    mtp_drafts_at: int = -1

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Asked for prompt logprobs (completions' echo) and not all of them were sent yet."""
        return self.sampling.prompt_logprobs is not None and self.prompt_logprobs_done < self.prompt_len - 1

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.num_computed
