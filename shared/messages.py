"""Every message that crosses a process boundary: one msgspec tagged union per direction of each edge.

Edges (docs/ARCHITECTURE.md §1):  api DEALER -> scheduler ROUTER : ApiToScheduler
                    scheduler ROUTER -> api DEALER : SchedulerToApi
                    scheduler ROUTER -> worker DEALER : SchedulerToWorker (the adopted worker, by boot id)
                    worker PUSH -> scheduler PULL   : WorkerToScheduler

Only token ids, positions, page/slot indices, sampling parameters and results travel. numpy arrays
are carried by shared/wire.py (fields typed `np.ndarray`: large ones as extra zero-copy frames, small ones
inside the header). No pickle.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
import numpy as np

from ferry.shared.bounds import Count32, Id, Int64, Positive32
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import Logprobs, StepBatch, StepOutput

ReplicaName = Annotated[str, msgspec.Meta(max_length=256)]  # an api replica's socket identity


class PoolReport(msgspec.Struct, frozen=True, kw_only=True):
    """The worker's memory plan, as far as the scheduler needs it: the only source of its pool sizes."""

    kv_pages: Positive32  # usable pages, ids 1..kv_pages (0 is the sentinel)
    page_size: Positive32
    linear_state_slots: (
        Count32  # usable linear-state slots, ids 1..linear_state_slots (0 = padding); 0 without linear attention
    )
    max_running_requests: Positive32
    max_prefill_tokens: Positive32
    max_model_len: Positive32
    plan_summary: str = ""  # human-readable plan, shown by the scheduler's /health
    vocab_size: Count32 = 0  # the model's vocabulary: prompt token ids must be below it (0: unknown, unchecked)
    # linear-state snapshots, ids 0..linear_state_snapshots-1: the prefix cache of hybrid models (0: none,
    # and then no prefix reuse for them)
    linear_state_snapshots: Count32 = 0
    # some routed experts live on the host: a prefill step then also pays a pass over the experts it misses,
    # so the scheduler cuts a prompt for a snapshot only where the snapshot saves more (batcher.py)
    experts_offloaded: bool = False
    # request slots the sliding KV groups keep rings for (plan/kv_groups.py), ids 1..kv_ring_slots (0 = padding):
    # a running request then holds one (StepBatch.linear_state_slots carries it), and the prefix cache is off,
    # since a ring keeps no prefix's K/V; 0: no ring
    kv_ring_slots: Count32 = 0
    # the expert pool as speculative decoding's controller prices a verify row's extra misses
    # (services/scheduler/draft_length.py): GPU slots and routed experts (all MoE layers), MoE layers, experts a
    # token routes to, one expert's bytes; 0: not reported (no MoE), misses not priced
    expert_slots: Count32 = 0
    expert_total: Count32 = 0
    moe_layers: Count32 = 0
    experts_top_k: Count32 = 0
    expert_bytes: Int64 = 0
    # --speculative-method mtp: the HBM bytes a step of the MTP head's draft chain reads (plan/mtp_layer.py's
    # MtpChainBytes), which the controller prices a draft with: once a chain step, the target's LM head and the MTP
    # layer's dense weights; per row chaining, its token's routed experts. 0: not drafting with MTP, unpriced
    mtp_lm_head_bytes: Int64 = 0
    mtp_layer_bytes: Int64 = 0
    mtp_row_expert_bytes: Int64 = 0


# ---- api -> scheduler --------------------------------------------------------------------------


class Submit(msgspec.Struct, tag=True, kw_only=True):
    req_id: Id  # unique per api replica; the scheduler keys requests by (replica identity, req_id)
    prompt_token_ids: np.ndarray  # int32 [P]; the scheduler checks dtype, shape and vocabulary per request
    sampling: SamplingParams
    max_tokens: Int64 | None = None  # None: as many as the model length allows (chat default); 0: score the prompt only


class Abort(msgspec.Struct, tag=True):
    req_id: Id


class ApiHeartbeat(msgspec.Struct, tag=True):
    """A replica's beat. `replica`: the identity of the replica's main socket, when the beat comes from
    its heartbeat thread on a socket of its own (so a busy event loop never silences it); "": the
    sending socket is the replica."""

    replica: ReplicaName = ""


ApiToScheduler = Union[Submit, Abort, ApiHeartbeat]


# ---- scheduler -> api --------------------------------------------------------------------------


class Tokens(msgspec.Struct, tag=True):
    """New tokens of one step for the requests of one api replica, in the same order as req_ids."""

    req_ids: np.ndarray  # int64 [N]
    token_ids: np.ndarray  # int32 [N]
    logprobs: tuple[Logprobs, ...] = ()  # of those tokens, for the requests that asked (req_id: the api's id)
    prompt_logprobs: tuple[Logprobs, ...] = ()  # prompt tokens' log-probabilities (echo), before any token


FINISH_REASONS = ("stop", "length", "abort")  # what Finished.reason may say


class Finished(msgspec.Struct, tag=True, kw_only=True):
    req_id: int
    reason: str  # one of FINISH_REASONS
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class Failed(msgspec.Struct, tag=True, kw_only=True):
    """The request cannot go on; error_type names a ferry.shared.errors class, which decides the HTTP status."""

    req_id: int
    error_type: str
    message: str
    param: str | None = None  # the Submit field it concerns ("max_tokens", "prompt"), if one: the api names its own


class SchedulerStatus(msgspec.Struct, tag=True, kw_only=True):
    """Sent to every api replica every heartbeat interval: liveness, readiness and gauges for /metrics."""

    boot_id: str  # a new value means a restarted scheduler, which has forgotten every request
    ready: bool
    reason: str  # why not ready ("" when ready)
    max_model_len: int = 0
    running: int = 0
    waiting: int = 0
    kv_pages_total: int = 0
    kv_pages_available: int = 0  # free + cached pages no request holds (evictable)
    kv_pages_cached: int = 0
    expert_hits: int = 0
    expert_misses: int = 0
    preemptions: int = 0
    prefix_hits: int = 0  # requests admitted with part of their prompt from the prefix cache (since the worker started)
    snapshot_evictions: int = 0  # linear-state snapshots dropped, with their KV pages or for room (hybrid models)
    state_snapshots: int = 0  # linear-state snapshots the prefix cache holds now
    draft_rows: int = 0  # speculative decoding: rows sent with drafts, drafts in them, drafts the worker kept
    drafted_tokens: int = 0
    accepted_drafts: int = 0
    # the draft-length controller (services/scheduler/draft_length.py): drafting rows it chose k for, the k's sum,
    # and the expert misses the drafts sent were expected to add (rounded down)
    draft_decisions: int = 0
    chosen_drafts: int = 0
    draft_misses_added: int = 0
    # and the step costs it prices with, as the worker measured them on the device (0: not measured yet)
    draft_decode_step_s: float = 0.0
    draft_chain_position_s: float = 0.0
    draft_verify_step_s: float = 0.0
    # the same drafting step from the scheduler's send to its answer, its chain's device time left out
    draft_verify_wall_s: float = 0.0


SchedulerToApi = Union[Tokens, Finished, Failed, SchedulerStatus]


# ---- scheduler -> worker -----------------------------------------------------------------------


class RunStep(msgspec.Struct, tag=True):
    batch: StepBatch


class SchedulerBeat(msgspec.Struct, tag=True):
    """Sent every heartbeat interval to the worker the scheduler adopted: the worker's /health shows
    whether its scheduler is there."""

    boot_id: str  # the scheduler's


SchedulerToWorker = Union[RunStep, SchedulerBeat]


# ---- worker -> scheduler -----------------------------------------------------------------------


class WorkerAlive(msgspec.Struct, tag=True, kw_only=True):
    """The worker's heartbeat. `pool` is set once the worker is ready to execute steps; a new boot_id
    tells the scheduler that a (re)started worker's pools are empty."""

    boot_id: str
    pool: PoolReport | None = None
    step_running_s: float = 0.0  # how long the step now executing has run (0: idle); a hung step shows here
    expert_hits: Int64 = 0
    expert_misses: Int64 = 0
    last_step: Int64 = 0  # the id of the last step the worker received: a step sent but never received shows here


class StepDone(msgspec.Struct, tag=True):
    output: StepOutput


class StepFailed(msgspec.Struct, tag=True, kw_only=True):
    step_id: Int64
    message: str


WorkerToScheduler = Union[WorkerAlive, StepDone, StepFailed]
