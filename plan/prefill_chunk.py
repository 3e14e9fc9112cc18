"""The prefill chunk chosen from memory (docs/ARCHITECTURE.md §2, "The prefill chunk").

The largest step's new tokens (`max_prefill_tokens`: a prompt is prefilled in chunks of at most
that many) set the activation workspace, and on a small GPU the workspace's bytes are expert slots
(an 8192-token step of Qwen3.6-35B-A3B takes 2-3 GiB: 800 FP8 experts). `--max-prefill-tokens`
fixes the chunk. Without it the plan takes, of CHUNK_CANDIDATES, the chunk that streams the fewest
expert bytes per prompt token: a chunk streams each expert it misses once (past the cache, through
the staging slots), so a prefill moves (experts without a slot) x (bytes an expert) / (chunk tokens)
per token over PCIe. Where a shorter chunk's workspace gives slots to nearly every expert, it wins
(the FP8 hybrid cut at 12 GiB: 824 experts without a slot at 8192 tokens, 101 at 2048), and decode
misses less too. Where most experts live on the host anyway (a full-size 35B at 24 GiB) and long prompts
are asked for, the longest chunk that fits wins, since the slots a shorter one adds are a few per cent of
the experts: each doubling halves what a long prompt streams (its 261,988 tokens cross PCIe 16 times at
16,384, 8 times at 32,768). With every expert resident a prefill streams nothing; 8,192 tokens are
then taken (tried first), since a step twice as long would only hold the decode rows batched with it
twice as long (2048 tokens already give the GEMMs rows enough to run at their rate).

Each candidate is priced by `measure` (the worker profiles the workspace on CUDA, `ferry plan`
and CPU boots estimate it), so the plan stays exact for the chunk it chooses. A candidate is
measured only when it could win: with no workspace at all the plan has its fewest experts without a
slot, and a chunk for which even that many streams more per token than the best so far is skipped
(so a resident boot profiles one step, an offloaded one with long prompts asked for up to three), as is a chunk
longer than one whose workspace did not fit, or than the longest step the running requests' contexts
allow (`max_running_requests x max_model_len`, where that is past 8,192)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ferry.plan.memory_defaults import (
    LONG_PROMPT_TOKENS,
    long_prompts_expected,
    offloaded_defaults,
    server_defaults,
    shrunk_defaults,
    sizing_source,
)
from ferry.plan.model_config import ModelSpec
from ferry.plan.planner import (
    DEFAULT_MAX_PREFILL_TOKENS,
    OFFLOADED_SNAPSHOTS_PER_RUNNING_REQUEST,
    Measured,
    Plan,
    PlanRequest,
    Resolved,
    make_plan,
    plan_budget,
    resolve,
)
from ferry.plan.store_plan import plan_for_expert_store
from ferry.shared.errors import PlanError

# in the order tried: DEFAULT_MAX_PREFILL_TOKENS first, which is the longest a resident plan takes; 16384 and
# 32768 only pay where experts stream and prompts past LONG_PROMPT_TOKENS are asked for
CHUNK_CANDIDATES = (8192, 16384, 32768, 4096, 2048)
# where none of them fits: the chunks a failed plan's message tries next, longest first (a prompt then takes more
# steps, each reading every expert it routes to once)
SHORTER_CHUNKS = (1024, 512, 256)
# a chat turn as the chooser weighs it where no long prompt is asked for: 4,096 prompt tokens for 128 output ones
PROMPT_TOKENS_PER_OUTPUT_TOKEN = 32
_CANDIDATES = ", ".join(map(str, CHUNK_CANDIDATES))


def plan_with_prefill_chunk(
    spec: ModelSpec, req: PlanRequest, measure: Callable[[Resolved | None], Measured], longest: int | None = None
) -> Plan:
    """The plan for `req`: its running requests and context sized from memory where no flag gave them
    (plan/memory_defaults.py), its prefill chunk chosen from memory unless --max-prefill-tokens gave it.
    `measure(r)` gives the facts (weights, workspace of a step as `r` resolves it, free memory); `measure(None)`
    the same with no workspace, measured nothing for. `longest`: no candidate past it is tried (expert-parallel
    ranks, which stream nothing, pass 8192)."""
    long_prompts = long_prompts_expected(spec, req)
    if req.max_running_requests is not None and req.max_model_len is not None:
        plan = _chunked_plan(spec, req, measure, longest, long_prompts)
        if (
            plan.experts.slots < spec.total_experts
            and plan.linear_state_snapshots.snapshots
            and req.linear_state_snapshots is None
        ):
            fewer = dataclasses.replace(req, snapshots_per_running_request=OFFLOADED_SNAPSHOTS_PER_RUNNING_REQUEST)
            plan = _chunked_plan(spec, fewer, measure, longest, long_prompts)  # more slots: it fits as well
        return dataclasses.replace(plan, sizing_source=sizing_source(req, offloaded=False))
    facts = measure(None)
    server = server_defaults(spec, req)
    if _unslotted_without_workspace(spec, server, facts) == 0:
        try:
            plan = _chunked_plan(spec, server, measure, longest, long_prompts)
        except PlanError:
            plan = None
        if plan is not None and plan.experts.slots >= spec.total_experts:
            return dataclasses.replace(plan, sizing_source=sizing_source(req, offloaded=False))
    single_user = offloaded_defaults(spec, req, plan_budget(spec, req, facts))
    while True:  # the defaults halve until the plan fits, or neither can shrink and its error names the flags
        try:
            plan = _chunked_plan(spec, single_user, measure, longest, long_prompts)
            return dataclasses.replace(plan, sizing_source=sizing_source(req, offloaded=True))
        except PlanError:
            smaller = shrunk_defaults(spec, req, single_user)
            if smaller is None:
                raise
            single_user = smaller


def _chunked_plan(
    spec: ModelSpec,
    req: PlanRequest,
    measure: Callable[[Resolved | None], Measured],
    longest: int | None,
    long_prompts: bool,
) -> Plan:
    """The plan for `req` (its running requests and context set), its chunk chosen unless the flag gave it."""
    if req.max_prefill_tokens is not None:
        plan = plan_for_expert_store(spec, req, measure(resolve(spec, req)))
        return dataclasses.replace(plan, max_prefill_tokens_source="--max-prefill-tokens")
    r = resolve(spec, req)
    # no step holds more than every running request's whole context: a longer chunk than that (past the
    # default's 8192, which is kept as before) would only take slots for a step that never comes; and a chunk
    # past 8192 pays only for prompts longer than it, where they are expected
    cap = (
        max(DEFAULT_MAX_PREFILL_TOKENS, r.max_running_requests * r.max_model_len)
        if long_prompts
        else DEFAULT_MAX_PREFILL_TOKENS
    )
    longest = cap if longest is None else min(longest, cap)
    best: Plan | None = None
    error: PlanError | None = None
    fewest_unslotted: int | None = None  # experts without a slot with no workspace at all: a lower bound
    too_long: int | None = None  # the shortest chunk whose workspace did not fit: no longer one is profiled
    for tokens in CHUNK_CANDIDATES:
        if (too_long is not None and tokens > too_long) or tokens > longest:
            continue
        if (
            best is not None
            and fewest_unslotted is not None
            and _cost(spec, fewest_unslotted, tokens, long_prompts) >= _streamed(spec, best, long_prompts)
        ):
            continue  # even with no workspace this chunk would stream more than the best
        chunk_req = dataclasses.replace(req, max_prefill_tokens=tokens)
        measured = measure(resolve(spec, chunk_req))
        try:
            plan = plan_for_expert_store(spec, chunk_req, measured)
        except PlanError as e:  # this chunk's workspace does not fit beside the floors: a shorter one may
            error, too_long = e, min(tokens, too_long or tokens)
            continue
        if fewest_unslotted is None:
            fewest_unslotted = _unslotted_without_workspace(spec, chunk_req, measured)
        if best is None or (_streamed(spec, plan, long_prompts), -tokens) < (
            _streamed(spec, best, long_prompts),
            -best.max_prefill_tokens,
        ):
            best = plan  # the fewest streamed, the longest chunk on a tie
        if plan.experts.slots >= spec.total_experts:
            break  # streams nothing: no shorter chunk does better, and a longer one only holds decode rows longer
    if best is None:
        assert error is not None
        raise PlanError(f"{error}\n{_shorter_chunk_hint(spec, req, measure)}")
    if best.experts.slots >= spec.total_experts:
        why = "every expert resident"
    else:
        unslotted = spec.total_experts - best.experts.slots
        if long_prompts:
            why = (
                f"{unslotted} experts without a slot, each streamed once a chunk: the fewest a prompt token of "
                f"{_CANDIDATES}"
            )
        else:
            tried = ", ".join(str(t) for t in CHUNK_CANDIDATES if t <= DEFAULT_MAX_PREFILL_TOKENS)
            longer = ", ".join(str(t) for t in CHUNK_CANDIDATES if t > DEFAULT_MAX_PREFILL_TOKENS)
            why = (
                f"{unslotted} experts without a slot: of {tried}, the fewest crossing PCIe for a chat turn of "
                f"{PROMPT_TOKENS_PER_OUTPUT_TOKEN} prompt tokens an output token (each chunk streams them once, decode "
                f"misses them); {longer} and prompt-only pricing where --max-model-len or the KV "
                f"pool asks for prompts past {LONG_PROMPT_TOKENS}"
            )
    return dataclasses.replace(best, max_prefill_tokens_source=f"chosen from memory: {why}")


def _shorter_chunk_hint(spec: ModelSpec, req: PlanRequest, measure: Callable[[Resolved | None], Measured]) -> str:
    """What a failed plan's message says of the chunk: the longest of SHORTER_CHUNKS with which it fits, with
    everything else unchanged, or that none does."""
    for tokens in SHORTER_CHUNKS:
        chunk_req = dataclasses.replace(req, max_prefill_tokens=tokens)
        try:
            plan_for_expert_store(spec, chunk_req, measure(resolve(spec, chunk_req)))
        except PlanError:
            continue
        return f"(no prefill chunk of {_CANDIDATES} tokens fits; --max-prefill-tokens {tokens} fits)"
    shortest = ", ".join(map(str, SHORTER_CHUNKS))
    return f"(no prefill chunk of {_CANDIDATES} tokens fits, nor of {shortest}: the chunk is not what to change)"


def _streamed(spec: ModelSpec, plan: Plan, long_prompts: bool) -> float:
    """What `plan` streams per prompt token (_cost)."""
    return _cost(spec, spec.total_experts - plan.experts.slots, plan.max_prefill_tokens, long_prompts)


def _cost(spec: ModelSpec, unslotted: int, tokens: int, long_prompts: bool) -> float:
    """Experts crossing PCIe per prompt token with `unslotted` experts without a slot and `tokens`-token chunks:
    each chunk streams them once; and, where no long prompt is asked for, a chat turn's decode too (its output
    a PROMPT_TOKENS_PER_OUTPUT_TOKEN-th of its prompt, each output token missing a layer's top-k in the share of
    experts without a slot, as uniform routing would). Where long prompts are asked for, their prefill is what
    they wait for, and decode is left out."""
    prefill = unslotted / tokens
    if long_prompts:
        return prefill
    decode = spec.num_experts_per_tok * len(spec.moe_layer_indices) * unslotted / spec.total_experts
    return prefill + decode / PROMPT_TOKENS_PER_OUTPUT_TOKEN


def _unslotted_without_workspace(spec: ModelSpec, req: PlanRequest, measured: Measured) -> int:
    """Experts without a slot were the workspace free: no chunk leaves fewer (all of them where even that
    plan does not fit)."""
    try:
        plan = make_plan(spec, req, dataclasses.replace(measured, workspace_bytes=0))
    except PlanError:
        return spec.total_experts
    return spec.total_experts - plan.experts.slots
