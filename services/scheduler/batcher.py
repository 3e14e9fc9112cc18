"""The scheduling policy: continuous batching with chunked prefill mixed into decode steps.

Each step: running requests first, oldest first (decodes take one token, unfinished prefills take
a chunk), then waiting requests in arrival order while the step's token budget
(`max_prefill_tokens`), `max_running_requests`, linear-state slots and pages allow. When a running
request needs a page and none is left, the newest running request not yet in this step is
preempted: its pages are freed (full ones stay in the prefix cache) and it goes back to the head
of the queue, to be recomputed from its prompt plus the tokens it already produced.

Scheduling ahead: while a decode step is in flight, the next one may be sent at once, before the
first one's tokens come back (`schedule_ahead`): the same requests, one token each, that token being
the one the worker samples in the step before (StepBatch.feed_sampled). So the worker starts step N+1
without waiting for the scheduler to hear of step N. Up to `schedule_ahead_steps` such steps may be
out beyond the oldest unanswered one (--schedule-ahead-steps), each fed by the one before it: with two,
step N+2 is already in the worker's socket when N+1 starts, so the device need not wait for the
scheduler's turn and the two hops even when they take longer than a step. It only continues what is
running: it never admits, preempts or grows a request past what it may hold, and it stops (the
pipeline drains) when a request waits while `max_running_requests` leaves room to admit it, when a
request's next token may be its last, or when a request's sampling reads its own output on the
worker (penalties, grammars).
With the batch full a waiting request could not be admitted anyway: the pipeline keeps going until
a running request ends (its last token, or a stop seen when its step comes back). The full policy
(`schedule`) runs only with no step in flight, so the pages of requests in a step are never touched
until its output comes back, and a request that finishes in step N while it is also in step N+1
keeps its pages, its state slot and its sampler state until N+1 returns (whose token for it is
dropped).

Speculative decoding (--speculative-method ngram|mtp; shared/speculation.py): once a step's rows and admissions are
placed, each decoding row whose request may speculate gets up to k drafts from prompt lookup over its tokens
(ngram_proposer.py) or, with mtp, from the worker's MTP head (the drafts its last answer brought: each sampling row
asks the worker for the k the controller expects to give its next row, `_mtp_row`), k <= --speculative-tokens
chosen per row by the draft-length controller (draft_length.py: the request's measured acceptance against the verify
positions' cost, their expert misses included), within the token budget left, the step's logits rows and the longest
verify graph's rows (`_give_drafts`, `_draft_cap`: a hybrid's row after a refusal carries its kept drafts again); the
worker verifies them in the same forward.
Its answer says how many it kept: those and the worker's own token are the request's next tokens, one at a time
through the stop checks, and the positions computed are counted by `computed_after_verify` (pages that held only
refused drafts go back). A request whose next row would draft is not scheduled ahead: its next drafts need the
tokens its answer brings; one the controller holds at k = 0 is, as without speculation.

Prefix cache of hybrid models (docs/ARCHITECTURE.md §1): a cached KV prefix is usable only with the
Gated DeltaNet state at its end, so these models reuse a prefix from a linear-state *snapshot*
(state_snapshots.py): a request starts from the deepest snapshot on its path (the KV pages before it
shared, the state copied into its own slot on the worker before its first chunk: StepBatch.restore_state)
and computes the rest. Snapshots sit on page boundaries, so the pages before one are all full pages of the
radix cache; a chunk that ends on a page boundary saves its state after the forward (StepBatch.save_state),
and the chunks are cut so that they end where a later request will want to start:
* the prompt's last page boundary at least PROMPT_END_MARGIN tokens before its end: where the next turn of
  a conversation, another choice of the same prompt (n > 1) or the same prompt sent again resumes (its
  tail is computed in the next step). The margin: the next turn renders the same history but not the
  generation prompt (`<|im_start|>assistant\n<think>\n`), so it parts from this prompt a few tokens before
  its end;
* where the request leaves the cached tree: a prefix computed before by a request that went another way
  (a shared system prompt, the second time it is seen), or shared with a request waiting beside it;
* every chunk of a long prefill that the step's budget cuts short (rounded down to a page boundary);
* every page boundary of its output, keeping only the last: where the next turn resumes when the chat
  template reproduces the output, and where a preempted request resumes.
A waiting request whose prefix a running one is about to snapshot waits for it, rather than compute the
same prefix twice. A chunk's one snapshot point is kept inside the step (StepBatch.save_offset: the linear layers save
the state there during the forward) rather than cut for, unless the chunk's own end keeps one (a row keeps
one state a step). With experts offloaded a cut costs a step that pays a pass over the missed experts, so
there points closer than OFFLOADED_SNAPSHOT_SPAN tokens to where a request starts, or to a deeper point,
are not cut for (nor waited for): a short prompt is one step, as without the cache.

Pure Python + numpy, no sockets: the service feeds it messages and sends what it returns.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ferry.services.scheduler.draft_length import ChainPrices, DraftLength, ExpertPrices
from ferry.services.scheduler.kv_page_pool import KvPagePool
from ferry.services.scheduler.linear_state_slots import LinearStateSlotAllocator
from ferry.services.scheduler.ngram_proposer import propose_ngram
from ferry.services.scheduler.radix_cache import Node
from ferry.services.scheduler.request import Request
from ferry.services.scheduler.state_snapshots import Snapshot, StateSnapshots
from ferry.shared.contract import sampling_wire_problems, step_output_problem, token_ids_problem
from ferry.shared.errors import EngineError, FerryError, InvalidRequest
from ferry.shared.messages import PoolReport
from ferry.shared.sampling import SamplingParams
from ferry.shared.speculation import (
    DEFAULT_SPECULATIVE_TOKENS,
    computed_after_verify,
    speculates,
    verify_row_tokens,
)
from ferry.shared.step import Logprobs, NewRequest, StepBatch, StepOutput
from ferry.shared.units import ceil_div

# a request whose grammar's matcher died on the worker (StepOutput.grammar_failures): the client's schema or
# grammar is what it cannot go on with, and the output so far is no complete value of it
GRAMMAR_FAILED = (
    "the output cannot go on under its grammar (response_format, output_config.format or a forced "
    "tool call's schema): the grammar engine stopped with: {}; simplify the schema"
)

# How many waiting requests a hybrid request's admission compares its prompt with, for the prefix they
# share (a snapshot point): a queue of requests sharing a system prompt is caught, a long queue costs nothing.
SHARED_PREFIX_LOOKAHEAD = 16
# The prompt-end snapshot sits at the last page boundary at least this many tokens before the prompt's end:
# a chat template's generation prompt (Qwen3.5's `<|im_start|>assistant\n<think>\n` is 5 tokens) is what the
# next turn's rendering of the same history does not repeat, so a snapshot inside it would be off the next
# turn's path one prompt in 16 (the others' tails grow by at most this many tokens).
PROMPT_END_MARGIN = 8
# With experts offloaded, a cut for a snapshot costs the request a step, and every step that prefills pays
# a pass over the experts it misses (the hybrid cut with 640 of 2048 slots: ~0.12 s; a full-size 35B at
# 24 GiB: ~0.7 s), as much as prefilling hundreds to thousands of tokens. There a snapshot point is kept
# only this many tokens past where the request starts and past the deeper points kept: a shorter span
# is recomputed by whoever would have started from it, for less than the cut costs. With every expert
# resident a cut costs a round trip of milliseconds, and every point is kept.
OFFLOADED_SNAPSHOT_SPAN = 256
# With experts offloaded every prefill step pays one pass over the experts without a GPU slot (0.1-1 s),
# so an idle scheduler holds new prompts while more keep arriving, at most a third of --prefill-coalesce-ms
# apart and the whole of it after the first, and one step serves them all (arrival_hold_s). Eight OpenAI
# clients started together reach the api over ~50 ms, gaps up to 19 ms apart (each encodes a 4k-token body
# in Python first): with a 4 ms gap the first went alone and the other seven paid
# a second pass behind it. A lone prompt would wait the gap, 20 ms, 10-13 % of a 2k prompt's time to its first
# token on the cuts, for nothing: so the hold is learned, and after a start from idle that stayed alone (a single
# user's next turn) the next prompt goes at once, while after a start that others joined it holds again.
DEFAULT_PREFILL_COALESCE_MS = 60.0
# decode steps out beyond the oldest unanswered one (--schedule-ahead-steps). Two: a resident step (~1.0 ms) is
# shorter than the chain from an answer to the next launch (~1.5 ms: the worker's launch, both hops, this process's
# turn), and with one ahead the device waited on it.
DEFAULT_SCHEDULE_AHEAD_STEPS = 2
ARRIVAL_GAP_FRACTION = 1 / 3


@dataclass
class Outcome:
    """What the api replicas must hear after a scheduler action."""

    tokens: list[tuple[Request, int]] = field(default_factory=list)
    logprobs: list[tuple[Request, Logprobs]] = field(default_factory=list)  # of the tokens, for requests that asked
    prompt_logprobs: list[tuple[Request, Logprobs]] = field(default_factory=list)  # prompt positions, each sent once
    finished: list[tuple[Request, str]] = field(
        default_factory=list
    )  # reason: stop | length | abort (asked by its replica)
    failed: list[tuple[Request, FerryError]] = field(default_factory=list)


@dataclass
class _Entry:
    req: Request
    query_len: int
    sample: bool
    inside: int = 0  # a snapshot point strictly inside the row's chunk, saved there during the forward (0: none)
    save: Snapshot | None = None  # the snapshot this row's state goes to (pending)
    save_at: int = 0  # ... the position it holds, a page boundary: the row's chunk end, or `inside`
    row_end: int = 0  # the position the row's chunk ends at
    drafts: tuple[int, ...] = ()  # draft tokens after the row's query_len tokens (speculative decoding), to verify
    hold: Snapshot | None = None  # a hybrid's drafting row: the snapshot its state is held in for the step
    mtp_drafts: int = 0  # --speculative-method mtp: drafts the worker's MTP head chains after this row


def check_pool(pool: PoolReport) -> None:
    """A PoolReport the scheduler can work with, or ValueError naming the bad field."""
    for name in ("kv_pages", "page_size", "max_running_requests", "max_prefill_tokens", "max_model_len"):
        if getattr(pool, name) < 1:
            raise ValueError(f"{name} must be at least 1, the worker reported {getattr(pool, name)}")
    if pool.linear_state_slots < 0:
        raise ValueError(f"linear_state_slots must be >= 0, the worker reported {pool.linear_state_slots}")


def _worth_a_cut(points: set[int], start: int, span: int, wanted: set[int] = frozenset()) -> set[int]:
    """The snapshot points kept: first those `wanted` by requests known to need them (a prefix shared with a
    waiting request, or one a request left the cached tree at), then the others (the prompt's end, kept
    for a next turn that may come). In each group the deepest first (it saves its users the most, and
    alone in its chunk it is kept inside the step, for no cut: BatchScheduler._save_inside), then each at
    least `span` tokens past `start` and from every point kept before it (OFFLOADED_SNAPSHOT_SPAN). So a
    prompt end a few pages past a shared system prompt gives way to it: the other way, the requests waiting
    for the system prompt's state would find none on their path and compute it again, one after another."""
    kept: list[int] = []
    for p in sorted(points & wanted, reverse=True) + sorted(points - wanted, reverse=True):
        if not kept or (p - start >= span and all(abs(q - p) >= span for q in kept)):
            kept.append(p)
    return set(kept)


def _prompt_lookup(req: Request, k: int) -> list[int]:
    """Up to k drafts for req by prompt lookup over its tokens (ngram_proposer.py)."""
    return propose_ngram(req.token_array.of(req.tokens), k)


def _mtp_drafts(req: Request, k: int) -> list[int] | None:
    """Up to k of the drafts the worker's MTP head chained after req's tokens; None where no chain ran after them
    (none was asked, or its tokens moved on): nothing was looked for."""
    return list(req.mtp_drafts[:k]) if req.mtp_drafts_at == len(req.tokens) else None


def _to_deepest_snapshot(chain: list[Node]) -> int:
    """How many nodes of a cached chain lead to the deepest one holding a linear-state snapshot (0: none)."""
    return next((i + 1 for i in range(len(chain) - 1, -1, -1) if chain[i].snapshot is not None), 0)


class BatchScheduler:
    def __init__(
        self,
        pool: PoolReport,
        first_step_id: int = 1,
        prefix_cache: bool = True,
        prefill_coalesce_s: float = DEFAULT_PREFILL_COALESCE_MS / 1000,
        schedule_ahead_steps: int = DEFAULT_SCHEDULE_AHEAD_STEPS,
        speculative_method: str = "off",
        speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS,
        drafter: Callable[[Request, int], list[int] | None] | None = None,
        pinned_drafts: int = 0,
    ):
        """`prefix_cache`: reuse cached prefixes (False: --no-prefix-cache, every prompt computed whole);
        `prefill_coalesce_s`: how long new prompts may wait for more (arrival_hold_s; 0: never);
        `schedule_ahead_steps`: decode steps that may be in flight beyond the oldest (0: none ahead);
        `speculative_method`: "ngram" or "mtp" gives decoding rows up to `speculative_tokens` drafts to verify
        (--speculative-method, --speculative-tokens; the module docstring), "off" none; `drafter`: where a
        row's up to k drafts come from (None: prompt lookup, or with mtp the worker's MTP head, which runs
        either way; the bench's oracle_drafter.py otherwise); `pinned_drafts`: the bench's fixed k (> 0: every
        drafting row's, DraftLength.pinned)."""
        check_pool(pool)
        self.pool = pool
        self.hybrid = pool.linear_state_slots > 0
        # Hybrid (linear-attention) models: a cached KV prefix is useless without the linear state at
        # the same position, so their prefix reuse needs the worker's linear-state snapshots; with none
        # (--linear-state-snapshots 0) it is off.
        # Sliding KV groups in rings (plan/kv_groups.py): a ring keeps only a window's K/V, not a cached
        # prefix's, so these models compute every prompt whole; each running request holds a slot for its rings.
        self.rings = pool.kv_ring_slots > 0
        snapshots = pool.linear_state_snapshots if self.hybrid and prefix_cache and not self.rings else 0
        self.kv = KvPagePool(
            pool.kv_pages,
            pool.page_size,
            prefix_reuse=prefix_cache and not self.rings and (not self.hybrid or snapshots > 0),
        )
        self.snapshots = StateSnapshots(snapshots)
        # ids that hold a hybrid's drafting rows' states for a step (_give_drafts): the prefix cache's, or without
        # it the worker's whole snapshot pool
        self.holds = self.snapshots if snapshots or not self.hybrid else StateSnapshots(pool.linear_state_snapshots)
        self.snapshot_span = OFFLOADED_SNAPSHOT_SPAN if pool.experts_offloaded else 1
        self.kv.cache.on_evict = self.snapshots.drop
        self.prefix_hits = 0  # admissions that started from a cached prefix
        # a running request's slot: its linear state's and its rings' (both pools have max_running_requests)
        self.linear_state = LinearStateSlotAllocator(max(pool.linear_state_slots, pool.kv_ring_slots))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.prefill_coalesce_s = prefill_coalesce_s if pool.experts_offloaded else 0.0
        self._arrivals: tuple[float, float] | None = None  # (first, last) arrival of the prompts held now
        # the last prompt that found the scheduler idle, how many arrived within prefill_coalesce_s of it, and
        # whether the next one to find it idle is held (arrival_hold_s): the first is, as a burst may follow
        self._idle_arrival: float | None = None
        self._joined_idle_arrival = 0
        self._hold_from_idle = True
        self.by_rid: dict[int, Request] = {}
        self.preemptions = 0
        self._forget: list[int] = []  # worker sampler state to drop before the next step
        self.schedule_ahead_steps = schedule_ahead_steps
        # (step id, rows), oldest first: at most 1 + schedule_ahead_steps
        self._in_flight: deque[tuple[int, list[_Entry]]] = deque()
        self._step_ids = itertools.count(first_step_id)
        self.speculative_method = speculative_method
        self.speculative_tokens = speculative_tokens
        self.mtp = speculative_method == "mtp"
        self.drafter = drafter or (_mtp_drafts if self.mtp else _prompt_lookup)
        # mtp prices a draft by the MTP head's chain that makes it; ngram's drafts cost nothing to make
        chain = ChainPrices.of(pool) if self.mtp else None
        self.draft_length = DraftLength(speculative_tokens, ExpertPrices.of(pool), chain, pinned=pinned_drafts)
        self.draft_rows = 0  # rows sent with drafts
        self.drafted_tokens = 0  # drafts sent in those rows
        self.accepted_drafts = 0  # of them, the ones the worker kept

    # ---- admission -------------------------------------------------------------------------------

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        """The request's output budget, or InvalidRequest if it can never run (checked once, up front),
        its `param` the Submit field to change: "max_tokens", or "prompt" when the prompt alone is too long."""
        limit = self.pool.max_model_len
        if prompt_len < 1:
            raise InvalidRequest("the prompt is empty: send at least one token", param="prompt")
        if max_tokens == 0:  # the prompt scored (completions' echo + logprobs), nothing generated
            if prompt_len > limit:
                raise InvalidRequest(
                    f"the prompt is {prompt_len} tokens but the model length is {limit}; shorten the prompt",
                    param="prompt",
                )
            if ceil_div(prompt_len, self.pool.page_size) > self.kv.total:
                raise InvalidRequest(
                    f"the prompt is {prompt_len} tokens but the server's KV pool holds "
                    f"{self.kv.total * self.pool.page_size}; shorten the prompt",
                    param="prompt",
                )
            return 0
        if prompt_len >= limit:
            raise InvalidRequest(
                f"the prompt is {prompt_len} tokens but the model length is {limit}: "
                f"no room for a single output token; shorten the prompt",
                param="prompt",
            )
        if max_tokens is None:
            # no max_tokens (the chat default): as many as the model length and the KV pool allow,
            # so a pool smaller than one max-length sequence never turns it into a 400
            max_tokens = min(limit, self.kv.total * self.pool.page_size) - prompt_len
            if max_tokens < 1:
                raise InvalidRequest(
                    f"the prompt is {prompt_len} tokens but the server's KV pool holds "
                    f"{self.kv.total * self.pool.page_size}: no room for a single output token; shorten the prompt",
                    param="prompt",
                )
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if prompt_len + max_tokens > limit:
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {prompt_len + max_tokens} "
                f"exceeds the model length {limit}; lower max_tokens to at most {limit - prompt_len}",
                param="max_tokens",
            )
        need = ceil_div(prompt_len + max_tokens, self.pool.page_size)
        if need > self.kv.total:
            fits = self.kv.total * self.pool.page_size - prompt_len
            raise InvalidRequest(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {need} KV pages but the "
                f"server's pool has {self.kv.total} pages of {self.pool.page_size} tokens"
                + (f"; lower max_tokens to at most {fits}" if fits >= 1 else "; shorten the prompt"),
                param="max_tokens" if fits >= 1 else "prompt",
            )
        return max_tokens

    def check_request(self, prompt: np.ndarray, sampling: SamplingParams) -> None:
        """The request as it came off the wire, held to the contract: InvalidRequest for it alone, never a
        failed step for the requests batched with it (docs/ARCHITECTURE.md §1, "Trust")."""
        problem = token_ids_problem("prompt_token_ids", prompt, self.pool.vocab_size)
        if problem is None and prompt.size and int(prompt.max()) > 2**31 - 1:
            problem = f"prompt_token_ids: token id {int(prompt.max())} does not fit int32"
        problems = [problem] if problem else []
        problems += sampling_wire_problems(sampling, self.pool.vocab_size)
        if problems:
            raise InvalidRequest("; ".join(problems))

    def add(
        self,
        rid: int,
        client: bytes,
        client_req_id: int,
        prompt: np.ndarray,
        sampling: SamplingParams,
        max_tokens: int | None,
        now: float | None = None,
    ) -> Request:
        """Queue a request; `now` (time.monotonic()) is its arrival, for arrival_hold_s."""
        self.check_request(prompt, sampling)
        resolved = self.resolve_max_tokens(len(prompt), max_tokens)
        req = Request(
            rid=rid,
            client=client,
            client_req_id=client_req_id,
            prompt_len=len(prompt),
            sampling=sampling,
            max_tokens=resolved,
            tokens=[int(t) for t in prompt],
        )
        if now is not None:
            self._note_arrival(now)
        self.waiting.append(req)
        self.by_rid[rid] = req
        if now is not None:
            first = self._arrivals[0] if self._arrivals is not None else now
            self._arrivals = (first, now)
        return req

    def _note_arrival(self, now: float) -> None:
        """Whether prompts start from idle alone or together, learned from the last start: a prompt finding
        nothing waiting, running or in flight opens a start (and the one before it decides whether this one is
        held); one arriving within prefill_coalesce_s of that start joined it, held with it or queued behind its
        step."""
        if not self.waiting and not self.running and not self._in_flight:
            if self._idle_arrival is not None:
                self._hold_from_idle = self._joined_idle_arrival > 0
            self._idle_arrival, self._joined_idle_arrival = now, 0
            self._arrivals = None  # a start from idle opens the hold's window
        elif self._idle_arrival is not None and now - self._idle_arrival <= self.prefill_coalesce_s:
            self._joined_idle_arrival += 1

    def arrival_hold_s(self, now: float) -> float:
        """How long to hold the next step for more prompts (0: send it now). Only with experts offloaded,
        nothing running or in flight (no decode waits on it) and prompts waiting: until a third of
        prefill_coalesce_s (ARRIVAL_GAP_FRACTION) after the last arrival while that is within
        prefill_coalesce_s of the first. Each prefill step pays one pass over the experts without a GPU
        slot, so prompts that arrive together share one. Not where the last start from idle stayed alone
        (_note_arrival): prompts then come one at a time, and a hold would only delay each. Held prompts as
        many as --max-running-requests go at once: no later arrival could join their step (eight streams
        sharing a system prompt would otherwise wait the gap, 20 ms, after the eighth)."""
        if not self.waiting:
            self._arrivals = None  # every held prompt was admitted (or aborted): the next one opens a window
        if not self.prefill_coalesce_s or self._arrivals is None or self._in_flight or self.running:
            return 0.0
        if not self._hold_from_idle:
            self._arrivals = None
            return 0.0
        if len(self.waiting) >= self.pool.max_running_requests:
            self._arrivals = None
            return 0.0
        first, last = self._arrivals
        until = min(last + self.prefill_coalesce_s * ARRIVAL_GAP_FRACTION, first + self.prefill_coalesce_s)
        if now >= until:
            self._arrivals = None  # the held prompts go: the next arrival starts a new window
            return 0.0
        return until - now

    def abort(self, rid: int, error: FerryError | None = None) -> Outcome:
        """Stop a request: its api replica asked (it has forgotten the request: a finish "abort"), or,
        with `error`, the server gave up on it (its replica declared lost), which is a failure for
        whoever still listens, never a normal-looking finish. A request in a step in flight ends
        when that step returns."""
        out = Outcome()
        req = self.by_rid.get(rid)
        if req is None:
            return out
        if error is not None and req.abort_error is None:
            req.abort_error = error
        if req.in_flight:
            req.abort_pending = True
        else:
            self._end_aborted(req, out)
        return out

    def _end_aborted(self, req: Request, out: Outcome) -> None:
        if req.abort_error is not None:
            self._fail(req, req.abort_error, out)
        else:
            self._finish(req, "abort", out)

    # ---- steps -----------------------------------------------------------------------------------

    @property
    def step_in_flight(self) -> bool:
        return bool(self._in_flight)

    @property
    def in_flight_step(self) -> int:
        """The id of the oldest step in flight, the one whose answer is due next (meaningful while
        step_in_flight)."""
        return self._in_flight[0][0] if self._in_flight else 0

    @property
    def steps_in_flight(self) -> int:
        return len(self._in_flight)

    def schedule(self) -> StepBatch | None:
        """The next step, or None when a step is in flight or nothing can run."""
        if self._in_flight:
            return None
        budget = self.pool.max_prefill_tokens
        entries: list[_Entry] = []
        in_step: set[int] = set()
        preempted = False
        if self.snapshots.total:
            # before the running prefills' chunks are cut: the prefixes they share with queued requests
            for req in itertools.islice(self.waiting, SHARED_PREFIX_LOOKAHEAD):
                self._state_being_computed(req)
        for req in list(self.running):
            if budget <= 0:
                break
            if req.rid not in self.by_rid or req not in self.running:
                continue  # preempted earlier in this loop
            q = self._chunk_len(req, budget)
            while not self.kv.grow(req, req.num_computed + q):
                victim = next(r for r in reversed(self.running) if r.rid not in in_step)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                entries.append(_Entry(req, q, self._samples(req, q), self._save_inside(req, q)))
                in_step.add(req.rid)
                budget -= q
        # No admissions in a step that had to preempt: the pool is short, and re-admitting the victim at
        # once would only thrash.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.pool.max_running_requests:
            req = self.waiting[0]
            if self._prefix_being_computed(req) or not self._admit(req, budget):
                break
            self.waiting.popleft()
            self.running.append(req)
            q = self._chunk_len(req, budget)
            entries.append(_Entry(req, q, self._samples(req, q), self._save_inside(req, q)))
            budget -= q
        if not entries:
            return None
        if self.speculative_method != "off":
            self._give_drafts(entries, budget)
        return self._build_batch(entries)

    def schedule_ahead(self) -> StepBatch | None:
        """The step after the newest one in flight, sent before that one's answer: each of its requests
        decodes the token it samples there. None unless a step is in flight, fewer than
        `schedule_ahead_steps` are ahead of the oldest, and the newest may be continued (the module
        docstring says when)."""
        if not 1 <= len(self._in_flight) <= self.schedule_ahead_steps:
            return None
        if self.waiting and len(self.running) < self.pool.max_running_requests:
            return None  # a request waits and could be admitted: the full policy must run
        _, previous = self._in_flight[-1]
        limit = self.pool.max_model_len
        # what the rows would agree to pay together for drafts (as _give_drafts and an MTP row's ask reckon it)
        drafting = [e.req for e in previous if e.sample and self._may_draft(e.req)]
        shared = self._shared_paid(drafting, len(previous), len(previous), self.speculative_tokens)
        for e in previous:
            r = e.req
            produced = r.output_len + r.in_flight  # its tokens once every step in flight is back
            if (
                not e.sample
                or e.drafts  # how many tokens it produces is known only when its answer is back
                # its next row's drafts come from the tokens its answer brings
                or (self._may_draft(r) and self.draft_length.would_draft(r.rid, len(previous), len(previous), shared))
                or r.done
                or r.abort_pending
                or r.sampling.reads_its_output
                or r.prompt_logprobs_pending
                or produced + 1 > r.max_tokens
                or len(r.tokens) + r.in_flight + 1 > limit
            ):
                return None
        # each row reads the position its previous row produced: the sequence so far plus the in-flight token
        positions = [len(e.req.tokens) + e.req.in_flight - 1 for e in previous]
        if not all(self.kv.grow(e.req, pos + 1) for e, pos in zip(previous, positions)):
            return None  # no page to grow into: the next full step may preempt (pages grown here are used then)
        entries = [_Entry(e.req, 1, True) for e in previous]
        for e in entries:
            if self._may_draft(e.req):
                self.draft_length.plain(e.req.rid)  # a decision for no drafts: the probes come due
        return self._build_batch(entries, ahead_positions=positions)

    def _may_draft(self, req: Request) -> bool:
        """Whether req's decoding rows get drafts (speculative decoding on, and its sampling allows it)."""
        return self.speculative_method != "off" and speculates(req.sampling)

    def _give_drafts(self, entries: list[_Entry], budget: int) -> None:
        """Drafts for the step's decoding rows, once every running row and admission has its place: drafts only
        fill what the step leaves. Per row, prompt lookup over its tokens (ngram_proposer.py), at most
        --speculative-tokens, the token budget left, and one fewer than the tokens left to the request (its
        max_tokens, the model length: the verify adds one of its own). The step's logits rows (one a sampling row,
        one more a draft) stay within max_running_requests, the sampling logits the plan's workspace holds. A
        row gets none where it does not end the request's tokens past its prompt (a prefill keeps its snapshot
        points), where its pages cannot grow without preempting, and, for a hybrid model, where no snapshot id is
        free to hold its state (speculation.computed_after_verify: refused drafts put the state back)."""
        logits_room = self.pool.max_running_requests - sum(e.sample for e in entries)
        if budget < 1 or logits_room < 1:
            return
        step_tokens = sum(e.query_len for e in entries)  # the step's tokens so far: the misses drafts add depend on it
        # each row's drafts at most (a drafter's k drafts are the first k of these)
        proposals = {}
        for e in entries:
            if self._draft_row(e) and (cap := self._draft_cap(e.req, e.query_len)) >= 1:
                found = self.drafter(e.req, cap)
                # a row that found none decodes plainly, scheduled ahead, until its next probe looks again
                self.draft_length.looked(e.req.rid, None if found is None else len(found))
                if found:
                    proposals[id(e)] = found
        # the most drafts a row of the step carries so far, at least what the rows that have drafts agree to pay
        # together: the eager step, or with mtp those chain positions, are paid (draft_length.py)
        drafting = [e.req for e in entries if id(e) in proposals]
        eager_paid = self._shared_paid(drafting, len(entries), step_tokens, self.speculative_tokens)
        for e in entries:
            if id(e) not in proposals:
                continue
            req, q = e.req, e.query_len
            if budget < 1 or logits_room < 1:
                return
            room = min(self._draft_cap(req, q), budget, logits_room)
            if room < 1 or (self.hybrid and not self.holds.free_count):
                continue
            k = self.draft_length.choose(req.rid, len(entries), step_tokens, room, eager_paid)
            drafts = proposals[id(e)][:k]
            if not drafts or not self.kv.grow(req, req.num_computed + q + len(drafts)):
                continue
            self.draft_length.sent(req.rid, step_tokens, len(drafts))
            step_tokens += len(drafts)
            eager_paid = max(eager_paid, len(drafts))
            if self.hybrid:
                e.hold = self.holds.take()  # a free id (free_count above): no cached snapshot is dropped
            e.drafts = tuple(drafts)
            budget -= len(drafts)
            logits_room -= len(drafts)

    def _shared_paid(self, drafting: list[Request], rows: int, step_tokens: int, limit: int) -> int:
        """What the `drafting` requests' rows of a step of `rows` rows would pay together (DraftLength.shared_paid):
        one reckoning for the drafts given, the chains asked and the steps sent ahead."""
        acceptances = [self.draft_length.acceptance(r.rid) for r in drafting]
        return self.draft_length.shared_paid(acceptances, rows, step_tokens, limit)

    def _draft_cap(self, req: Request, q: int) -> int:
        """The most drafts req's row of q tokens may carry: --speculative-tokens, one fewer than the tokens left to
        it (its max_tokens, the model length: the verify adds one of its own), and what keeps the row within a
        verify graph (speculation.verify_row_tokens: a hybrid's row after refusals carries its kept drafts again)."""
        left = min(req.max_tokens - req.output_len, self.pool.max_model_len - len(req.tokens))
        return min(self.speculative_tokens, left - 1, verify_row_tokens(self.speculative_tokens) - q)

    def _draft_row(self, e: _Entry) -> bool:
        """Whether the row may carry drafts: a sampling row past its prompt, not keeping a snapshot inside, of a
        request that may draft."""
        req = e.req
        return self._may_draft(req) and e.sample and req.num_computed >= req.prompt_len and not e.inside

    @staticmethod
    def _samples(req: Request, q: int) -> bool:
        """Whether this chunk ends the computed sequence, so its last position samples the next token
        (never for a request that only scores its prompt: max_tokens 0)."""
        return req.num_computed + q == len(req.tokens) and req.max_tokens > 0

    def _prefix_being_computed(self, req: Request) -> bool:
        """A running request still prefills the same first page (n > 1 choices, or the same prompt sent
        twice at once): wait for its pages to reach the prefix cache rather than compute them twice.
        Hybrid models wait for the snapshot they will start from instead (`_state_being_computed`)."""
        ps = self.pool.page_size
        if not self.kv.prefix_reuse or req.prompt_logprobs_pending or len(req.tokens) <= ps:
            return False
        if self.snapshots.total:
            return self._state_being_computed(req)
        head = req.tokens[:ps]
        return any(r.num_computed < r.prompt_len and r.tokens[:ps] == head for r in self.running)

    # ---- hybrid models' prefix cache: snapshots --------------------------------------------------

    def _state_being_computed(self, req: Request) -> bool:
        """A running request still prefills a prefix `req` shares, past the deepest snapshot `req` could
        start from now: that request's chunks are made to end at the shared prefix's last page boundary
        (a snapshot point) and `req` waits for the snapshot, rather than compute the prefix twice. A
        request that already computed past the shared prefix without keeping its state there is not
        waited for: `req` computes it, and keeps it (the point where it leaves the cached tree)."""
        ps = self.pool.page_size
        if req.prompt_logprobs_pending or len(req.tokens) <= ps:
            return False
        head, last = req.tokens[:ps], (len(req.tokens) - 1) // ps * ps
        ahead = []  # (running prefill, the prefix req shares with it) that it has not computed yet
        for r in self.running:
            if r.to_compute > 1 and r.tokens[:ps] == head:
                shared = min(self._shared_pages(req, r) * ps, last, (len(r.tokens) - 1) // ps * ps)
                shared = min(shared, self._prompt_end(r))  # up to r's own prompt-end snapshot: no cut of its own
                if r.num_computed < shared:
                    ahead.append((r, shared))
        if not ahead:
            return False
        depth = _to_deepest_snapshot(self.kv.cache.match(req.tokens, max(shared for _, shared in ahead) // ps)) * ps
        for r, shared in ahead:
            # worth waiting for: it saves req a span's worth, and costs r no cut within a span of its own
            # points but its prompt end, which gives way to it (_worth_a_cut: a wanted point comes first)
            near = {p for p in r.snapshot_points if p != shared and abs(shared - p) < self.snapshot_span}
            if shared - depth >= self.snapshot_span and near <= {self._prompt_end(r)}:
                r.snapshot_points -= near
                r.snapshot_points.add(shared)
                return True
        return False

    def _shared_pages(self, a: Request, b: Request) -> int:
        """How many full pages a's and b's tokens share from the start (remembered on `a`: a waiting
        request's tokens do not change, nor do a prefilling one's)."""
        n = a.shared_pages.get(b.rid)
        if n is None:
            ps, ta, tb = self.pool.page_size, a.tokens, b.tokens
            limit, n = min(len(ta), len(tb)) // ps, 0
            while n < limit and ta[n * ps : (n + 1) * ps] == tb[n * ps : (n + 1) * ps]:
                n += 1
            a.shared_pages[b.rid] = n
        return n

    def _snapshot_chain(self, req: Request) -> tuple[list[Node], int]:
        """(the cached chain of req's prefix, how many of its nodes lead to the deepest snapshot on it):
        reuse ends at that snapshot, since the state after it is not kept."""
        # prompt logprobs come from computing the positions: reuse only a prefix whose logprobs were sent
        chain = self.kv.match(req, req.prompt_logprobs_done if req.prompt_logprobs_pending else None)
        return chain, _to_deepest_snapshot(chain)

    def _prompt_end(self, req: Request) -> int:
        """Where req's prompt-end snapshot goes (the module docstring): its last page boundary at least
        PROMPT_END_MARGIN tokens before the end of its tokens."""
        ps = self.pool.page_size
        return max(0, len(req.tokens) - PROMPT_END_MARGIN) // ps * ps

    def _reuse_snapshot(self, req: Request) -> None:
        """Start `req` from the deepest snapshot on its path (its KV pages held, the state restored into its
        slot in its first step) and choose where its chunks end (the module docstring's snapshot points)."""
        ps = self.pool.page_size
        chain, usable = self._snapshot_chain(req)
        self.kv.hold(req, chain[:usable])
        if usable:
            snap = chain[usable - 1].snapshot
            self.snapshots.touch(snap)
            req.restore_from = snap.id
        last, end = (
            (len(req.tokens) - 1) // ps * ps,
            self._prompt_end(req),
        )  # the deepest reusable point; the prompt's end
        wanted = {len(chain) * ps}  # where it leaves the cached tree
        for other in itertools.islice(self.waiting, SHARED_PREFIX_LOOKAHEAD):
            if other is not req and other.tokens[:ps] == req.tokens[:ps]:  # the prefix they share, up to `end`
                wanted.add(min(self._shared_pages(other, req) * ps, (len(other.tokens) - 1) // ps * ps, end))
        req.snapshot_points = _worth_a_cut(
            {p for p in wanted | {end} if req.num_computed < p <= last}, req.num_computed, self.snapshot_span, wanted
        )

    def _chunk_len(self, req: Request, budget: int) -> int:
        """The tokens of req's next chunk: as many as remain and the budget allows; with snapshots, a
        prefill chunk ends at the next of its snapshot points, and one the budget cuts short ends on a page
        boundary (its state is kept there: a long prefill keeps one at every chunk's end)."""
        q = min(req.to_compute, budget)
        if not self.snapshots.total or q <= 1:
            return q
        start, end, ps = req.num_computed, req.num_computed + q, self.pool.page_size
        cuts = sorted(p for p in req.snapshot_points if start < p < end)
        budget_cut = end < len(req.tokens) and end - end % ps > start
        if not cuts:
            return end - end % ps - start if budget_cut else q
        if len(cuts) == 1 and not budget_cut and not self._end_keeps_snapshot(req, end):
            return q  # its one point is saved inside the chunk (_save_inside)
        if cuts[0] - start < self.snapshot_span:  # a cut this close is not worth its step (offloaded experts)
            req.snapshot_points.discard(cuts[0])
            return self._chunk_len(req, budget)
        return cuts[0] - start

    def _save_inside(self, req: Request, q: int) -> int:
        """The snapshot point saved inside req's next chunk of q tokens (0: none): the chunk's only point,
        when its end keeps no snapshot of its own (a row saves one state a step: _end_keeps_snapshot). The
        linear layers keep the state there during the forward, so the chunk is not cut into two steps
        (_chunk_len)."""
        start, end = req.num_computed, req.num_computed + q
        if not self.snapshots.total or q <= 1 or self._end_keeps_snapshot(req, end):
            return 0
        inside = [p for p in req.snapshot_points if start < p < end]
        return inside[0] if len(inside) == 1 else 0

    def _end_keeps_snapshot(self, req: Request, end: int) -> bool:
        """Whether a chunk of req ending at `end` saves its state there. A chunk ending on a page boundary
        keeps its end: a long prefill's every-chunk point where the budget cuts it short, or the exact end
        of what there is to compute (for a request extending this prompt exactly, a /v1/completions prompt
        sent again longer). With experts offloaded the last chunk keeps its inside point instead: the cut
        both would need costs a step with a pass over the missed experts (the bench's 2,000-token prompt is
        125 pages; its TTFT on the hybrid cut rose from 0.18 s to 0.24 when that cut came in), while the
        next turn, another choice of the prompt and the prompt sent again all resume at the inside point,
        a few tokens before the end (PROMPT_END_MARGIN); the output keeps its own page boundaries."""
        return end % self.pool.page_size == 0 and (end < len(req.tokens) or self.snapshot_span == 1)

    def _save_for(self, req: Request, end: int) -> Snapshot | None:
        """The pending snapshot a row ending at page boundary `end` saves into, or None (every id is pending).
        In the output only the last one is kept: it takes the id of the request's previous one there."""
        rolling = end > req.prompt_len
        if rolling and req.rolling is not None and req.rolling.pending:
            return None  # its last one has not landed yet (pages of a token or two): one in flight is enough
        if rolling and req.rolling is not None and req.rolling.node is not None:
            snap = self.snapshots.recycle(req.rolling)
        else:
            snap = self.snapshots.take()
        if rolling:
            req.rolling = snap
        return snap

    def _attach_snapshot(self, e: _Entry) -> None:
        """A row's save landed: its snapshot joins the radix node whose page ends at its position."""
        req, snap, e.save = e.req, e.save, None
        node = None
        if req.num_computed == e.row_end:
            self.kv.cache_full_pages(req)
            i = e.save_at // self.pool.page_size - 1
            node = req.nodes[i] if i < len(req.nodes) else None
        if node is None or not self.snapshots.attach(snap, node):
            if node is None:
                self.snapshots.free(snap)
            if req.rolling is snap:
                req.rolling = None

    def _abandon_saves(self, entries: list[_Entry]) -> None:
        for e in entries:
            if e.save is not None:
                if e.req.rolling is e.save:
                    e.req.rolling = None
                self.snapshots.free(e.save)
                e.save = None

    def _admit(self, req: Request, budget: int) -> bool:
        slot = 0
        if self.hybrid or self.rings:
            slot = self.linear_state.allocate()
            if slot is None:
                return False
        if self.snapshots.total:
            self._reuse_snapshot(req)
        else:
            # prompt logprobs come from computing the positions: reuse only a prefix whose logprobs were sent
            self.kv.reuse_prefix(req, req.prompt_logprobs_done if req.prompt_logprobs_pending else None)
        if not self.kv.grow(req, req.num_computed + self._chunk_len(req, budget)):
            self.kv.release(req)
            self.linear_state.release(slot)
            req.restore_from = -1
            return False
        req.linear_state_slot = slot
        if req.num_computed:
            self.prefix_hits += 1
        if not req.admitted_once:
            req.cached_tokens = req.num_computed
            req.admitted_once = True
        return True

    def _build_batch(self, entries: list[_Entry], ahead_positions: list[int] | None = None) -> StepBatch:
        """The step of these rows, now in flight. `ahead_positions`: a step scheduled ahead, every row
        decoding, at these positions, the token the worker sampled for it in the step before."""
        n = len(entries)
        tokens: list[int] = []
        new_requests = []
        prompt_logprobs = np.zeros(n, dtype=bool)
        restore = np.full(n, -1, dtype=np.int32)
        save = np.full(n, -1, dtype=np.int32)
        hold = np.full(n, -1, dtype=np.int32)
        query_lens = np.array([e.query_len + len(e.drafts) for e in entries], dtype=np.int32)
        draft_lens = np.array([len(e.drafts) for e in entries], dtype=np.int32)
        mtp_drafts = np.zeros(n, dtype=np.int32)
        next_tokens = np.full(n, -1, dtype=np.int32)
        # the longest MTP chain a row before asks for, at least what the rows agree to pay together: its positions
        # are paid (draft_length.py)
        chained = 0
        # the logits rows the next step leaves for drafts (_give_drafts): no row asks for a chain past them
        ask_room = self.pool.max_running_requests - sum(e.sample for e in entries)
        if self.mtp:
            asking = [e.req for e in entries if e.sample and self._may_draft(e.req)]
            chained = self._shared_paid(asking, n, n, min(self.speculative_tokens, ask_room))
        offset = query_lens.copy()  # where each row's state is saved: its end unless kept inside
        ps = self.pool.page_size
        for i, e in enumerate(entries):
            r = e.req
            restore[i], r.restore_from = r.restore_from, -1
            end = (r.num_computed if ahead_positions is None else ahead_positions[i]) + e.query_len
            e.row_end = end
            if e.drafts:  # its state may be put back (refused drafts): it keeps no snapshot, and holds one hybrid's
                hold[i] = -1 if e.hold is None else e.hold.id
            elif e.inside:  # the chunk's one point, kept inside it; its end then keeps none (_save_inside)
                if (snap := self._save_for(r, e.inside)) is not None:
                    e.save, e.save_at, save[i], offset[i] = snap, e.inside, snap.id, e.inside - r.num_computed
            elif self.snapshots.total and end % ps == 0 and (snap := self._save_for(r, end)) is not None:
                e.save, e.save_at, save[i] = snap, end, snap.id
            # rows of this chunk at positions p give the logprob of token p + 1; those still to send: done..P-2
            prompt_logprobs[i] = (
                r.prompt_logprobs_pending
                and r.num_computed <= r.prompt_len - 2
                and r.num_computed + e.query_len - 1 >= r.prompt_logprobs_done
            )
            if self.mtp:
                mtp_drafts[i], next_tokens[i] = self._mtp_row(e, end, n, chained, ask_room)
                chained = max(chained, int(mtp_drafts[i]))
                ask_room -= int(mtp_drafts[i])
            if ahead_positions is None:
                tokens.extend(r.tokens[r.num_computed : r.num_computed + e.query_len])
                tokens.extend(e.drafts)
            else:
                tokens.append(0)  # the worker puts the token it sampled for this request in the step before
            r.in_flight += 1
            if not r.announced:
                # After a preemption the tokens already produced are part of the recomputed prefix, so
                # they count as seen for the repetition penalty.
                new_requests.append(
                    NewRequest(req_id=r.rid, prompt_token_ids=np.asarray(r.tokens, dtype=np.int32), sampling=r.sampling)
                )
                r.announced = True
        # made once the rows' pages are grown (an MTP row's grow for its chain: _mtp_row)
        page_table = np.zeros((n, max(len(e.req.pages) for e in entries)), dtype=np.int32)
        for i, e in enumerate(entries):
            page_table[i, : len(e.req.pages)] = e.req.pages
        step_id = next(self._step_ids)
        self._in_flight.append((step_id, entries))
        forget, self._forget = self._forget, []
        contexts = [e.req.num_computed for e in entries] if ahead_positions is None else ahead_positions
        return StepBatch(
            step_id=step_id,
            req_ids=np.array([e.req.rid for e in entries], dtype=np.int64),
            tokens=np.array(tokens, dtype=np.int32),
            query_lens=query_lens,
            context_lens=np.array(contexts, dtype=np.int32),
            page_table=page_table,
            linear_state_slots=np.array([e.req.linear_state_slot for e in entries], dtype=np.int32),
            reset_linear_state=np.array([c == 0 for c in contexts], dtype=bool),
            sample=np.array([e.sample for e in entries], dtype=bool),
            new_requests=tuple(new_requests),
            finished_req_ids=tuple(forget),
            prompt_logprobs=prompt_logprobs if prompt_logprobs.any() else None,  # None: the step is as before
            feed_sampled=None if ahead_positions is None else np.ones(n, dtype=bool),
            restore_state=restore if (restore >= 0).any() else None,  # None: no row copies a state
            save_state=save if (save >= 0).any() else None,
            save_offset=offset if (offset < query_lens).any() else None,
            draft_lens=draft_lens if draft_lens.any() else None,  # None: no row drafts
            hold_state=hold if (hold >= 0).any() else None,
            mtp_drafts=mtp_drafts if mtp_drafts.any() else None,  # None: no row asks the MTP head for drafts
            next_tokens=next_tokens if (next_tokens >= 0).any() else None,
        )

    def _mtp_row(self, e: _Entry, end: int, rows: int, chained: int, ask_room: int) -> tuple[int, int]:
        """(drafts the MTP head chains after the row, the token after the row's chunk or -1) for a row of
        --speculative-method mtp (services/worker/mtp_drafts.py): a sampling row of a request that may draft asks
        for the drafts the controller expects to give its next row (DraftLength.expected, for a step of `rows`
        rows like this one, where rows before it chain `chained` positions), where its pages grow to hold the
        chain's K/V (k - 1 slots past the row's tokens), the model length and `ask_room` (the logits rows the next
        step leaves for drafts, less the rows before it asked for) allow; a prompt's chunk that does not sample
        gives the prompt's next token (the MTP layer's input at the chunk's last position). `end`: the position
        the row's tokens (its drafts left out) end at."""
        r = e.req
        if not e.sample:
            return 0, r.tokens[end] if end < len(r.tokens) else -1
        if not self._may_draft(r):
            return 0, -1
        reach = end + len(e.drafts)  # the tokens the row holds, its drafts included
        room = min(self.speculative_tokens, self.pool.max_model_len - reach + 1, ask_room)
        k = self.draft_length.expected(r.rid, rows, rows + chained, room, chained) if room >= 1 else 0
        if k < 1 or not self.kv.grow(r, reach + k - 1):
            return 0, -1
        e.mtp_drafts = k
        return k, -1

    def complete(self, output: StepOutput, wall_s: float = 0.0) -> Outcome:
        """Apply the in-flight step's output: advance requests, emit tokens, finish the done ones. `wall_s`: the
        step's seconds from its send to its answer (the service's clock; 0: not measured), which prices a drafting
        step the worker timed (draft_length.py)."""
        out = Outcome()
        if not self._in_flight or output.step_id != self._in_flight[0][0]:
            # A late answer to a step already given up on (--step-timeout): its requests failed
            # then. Failing the step now in flight would cascade to every later step.
            return out
        problem = step_output_problem(output, self.pool.vocab_size)
        if problem is not None:
            return self.fail_step(
                output.step_id, EngineError(f"the worker's answer to step {output.step_id} is unusable: {problem}")
            )
        entries = self._landed()
        verify_wall_s = 0.0
        if output.verify_step_s > 0 and wall_s > 0:  # a drafting step the worker timed: sent alone, never ahead
            chained = max((e.mtp_drafts for e in entries), default=0)
            verify_wall_s = max(wall_s - chained * output.chain_position_s, 0.0)
        self.draft_length.note_step_costs(
            output.decode_step_s, output.chain_position_s, output.verify_step_s, verify_wall_s
        )
        sampled = dict(zip(output.req_ids.tolist(), output.token_ids.tolist()))
        vocab = self.pool.vocab_size
        sampled_lps = {lp.req_id: lp for lp in output.sampled_logprobs}
        accepted = (
            {}
            if output.accepted_drafts is None
            else dict(zip(output.req_ids.tolist(), output.accepted_drafts.tolist()))
        )
        mtp = {} if output.mtp_drafts is None else dict(zip(output.req_ids.tolist(), output.mtp_drafts.tolist()))
        grammar_failures = dict(output.grammar_failures)
        for lp in output.prompt_logprobs:
            self._take_prompt_logprobs(lp, out)
        for e in entries:
            req = e.req
            if req.done:  # it finished in the step before, scheduled ahead of its end: drop this row
                self._abandon_saves([e])
                self._release_if_idle(req)
                continue
            kept = accepted.get(req.rid, -1) if e.drafts else 0  # -1: the answer says nothing of its drafts
            if not 0 <= kept <= len(e.drafts):
                self._fail(
                    req,
                    EngineError(f"the worker kept {kept} of request {req.rid}'s {len(e.drafts)} drafts (-1: unsaid)"),
                    out,
                )
                continue
            if e.drafts:
                self.draft_rows += 1
                self.drafted_tokens += len(e.drafts)
                self.accepted_drafts += kept
                self.draft_length.observe(req.rid, len(e.drafts), kept)
                q = e.query_len + len(e.drafts)
                req.num_computed = computed_after_verify(req.num_computed, q, len(e.drafts), kept, self.hybrid)
            else:
                req.num_computed += e.query_len
            if e.save is not None:
                self._attach_snapshot(e)
            if req.abort_pending:
                self._end_aborted(req, out)
                continue
            if req.max_tokens == 0 and req.num_computed == len(req.tokens):
                self._finish(req, "length", out)  # the prompt is scored; nothing to generate
                continue
            if e.sample:
                token = sampled.get(req.rid)
                if token is None:
                    self._fail(req, EngineError(f"the worker returned no token for request {req.rid}"), out)
                    continue
                if token < 0 or (vocab and token >= vocab) or token > 2**31 - 1:
                    self._fail(
                        req,
                        EngineError(f"the worker returned token {token} for request {req.rid}, outside the vocabulary"),
                        out,
                    )
                    continue
                if (why := grammar_failures.get(req.rid)) is not None:  # its token is no output, only a filler
                    self._fail(req, InvalidRequest(GRAMMAR_FAILED.format(why)), out)
                    continue
                reason = None
                for t in (*e.drafts[:kept], token):  # the kept drafts, then the worker's own token
                    req.tokens.append(t)
                    req.output_len += 1
                    out.tokens.append((req, t))
                    if (reason := self._finish_reason(req, t)) is not None:
                        break  # a stop or the length limit: the tokens after it are dropped
                if e.mtp_drafts and req.rid in mtp:  # the MTP head's drafts after the tokens just added
                    req.mtp_drafts = tuple(t for t in mtp[req.rid][: e.mtp_drafts] if t >= 0)
                    req.mtp_drafts_at = len(req.tokens)
                if (lp := sampled_lps.get(req.rid)) is not None:
                    out.logprobs.append((req, lp))
                if reason:
                    self._finish(req, reason, out)
                    continue
            if (e.drafts or e.mtp_drafts) and not req.in_flight:  # pages that held only drafts' K/V go back
                self.kv.trim(req, len(req.tokens))
            self.kv.cache_full_pages(req)
        return out

    def _take_prompt_logprobs(self, lp: Logprobs, out: Outcome) -> None:
        """The part of `lp` not sent yet (positions done+1 .. prompt_len-1), to be sent now."""
        req = self.by_rid.get(lp.req_id)
        if req is None or not req.prompt_logprobs_pending:
            return
        first, last = req.prompt_logprobs_done + 1, req.prompt_len - 1  # positions wanted, inclusive
        a = max(first, lp.start) - lp.start
        b = min(last + 1, lp.start + len(lp.token_logprobs)) - lp.start
        if lp.start > first or b <= a:
            return  # a gap (never expected: chunks arrive in order) or nothing new
        part = Logprobs(
            req_id=req.client_req_id,
            start=lp.start + a,
            token_logprobs=lp.token_logprobs[a:b],
            top_ids=lp.top_ids[a:b],
            top_logprobs=lp.top_logprobs[a:b],
        )
        req.prompt_logprobs_done = lp.start + b - 1
        out.prompt_logprobs.append((req, part))

    def fail_step(self, step_id: int, err: FerryError) -> Outcome:
        """The worker could not run the in-flight step: its requests fail, everything else goes on."""
        out = Outcome()
        if not self._in_flight or step_id != self._in_flight[0][0]:
            return out  # a late failure of a step already given up on (see complete)
        self._fail_rows(self._landed(), err, out)
        return out

    def fail_in_flight(self, err: FerryError) -> Outcome:
        """Every step in flight failed (never delivered, or lost on the way): a step scheduled ahead
        goes with the one before it."""
        out = Outcome()
        while self._in_flight:
            self._fail_rows(self._landed(), err, out)
        return out

    def _fail_rows(self, entries: list[_Entry], err: FerryError, out: Outcome) -> None:
        self._abandon_saves(entries)
        for e in entries:
            if e.req.done:  # failed (or finished) with an earlier step: only its resources wait
                self._release_if_idle(e.req)
            else:
                self._fail(e.req, err, out)

    def _landed(self) -> list[_Entry]:
        """The oldest step in flight is back: its rows, each request holding one step fewer, the snapshots that
        held drafting rows' states free again (the step has put back what it was to)."""
        _, entries = self._in_flight.popleft()
        for e in entries:
            e.req.in_flight -= 1
            if e.hold is not None:
                self.holds.free(e.hold)
                e.hold = None
        return entries

    def fail_all(self, err: FerryError) -> Outcome:
        """The worker is gone: every request fails now (its pools died with it)."""
        out = Outcome()
        for _, entries in self._in_flight:
            for e in entries:
                e.req.in_flight = 0  # the worker and its pools are gone: nothing is in flight any more
        self._in_flight.clear()
        for req in [*self.running, *self.waiting]:
            self._fail(req, err, out)
        return out

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _finish_reason(self, req: Request, token: int) -> str | None:
        if token in req.sampling.stop_token_ids:
            return "stop"
        if req.output_len >= req.max_tokens or len(req.tokens) >= self.pool.max_model_len:
            return "length"
        return None

    def _release(self, req: Request) -> None:
        self.kv.release(req)
        self.linear_state.release(req.linear_state_slot)
        req.linear_state_slot = 0
        if req.announced:
            self._forget.append(req.rid)
            req.announced = False

    def _remove(self, req: Request) -> None:
        """Out of the queues for good; its pages, state slot and sampler state are released once no
        step in flight holds it (a step scheduled ahead may still)."""
        req.done = True
        self._release_if_idle(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.by_rid.pop(req.rid, None)
        self.draft_length.forget(req.rid)

    def _release_if_idle(self, req: Request) -> None:
        if req.in_flight == 0:
            self._release(req)

    def _finish(self, req: Request, reason: str, out: Outcome) -> None:
        self._remove(req)
        out.finished.append((req, reason))

    def _fail(self, req: Request, err: FerryError, out: Outcome) -> None:
        self._remove(req)
        out.failed.append((req, err))

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)
        self.waiting.appendleft(req)
        self.preemptions += 1
