"""--max-running-requests and --max-model-len when not given: sized from memory (docs/ARCHITECTURE.md §2,
"Defaults from memory").

Where the card holds every expert, the defaults are a server's: DEFAULT_MAX_RUNNING_REQUESTS running requests
and the model's whole context. Where it cannot, every byte those take is an expert slot, and the slots set
decode speed: each running request of a hybrid model holds a linear-state slot (61 MiB for Qwen3.6-35B-A3B),
and the KV pool's floor is one sequence of max_model_len (5 GiB for its 262,144 tokens). There the defaults
are a single user's: OFFLOADED_MAX_RUNNING_REQUESTS, the longest context (the model's, or a power of two
of at least MIN_CONTEXT) whose one sequence's KV takes at most 1/KV_FLOOR_SHARE of the budget (32,768 tokens
of the 35B at 24 GiB, as llama.cpp's and LM Studio's few-thousand-token defaults, only longer), and one
linear-state snapshot a running request; halved until the plan fits. A flag given is kept; a KV flag (--num-tokens,
--num-pages, --kv-reserve-tokens) sizes the pool, so max_model_len then stays the model's."""

from __future__ import annotations

import dataclasses

from ferry.plan import pool_layout as L
from ferry.plan.model_config import ModelSpec
from ferry.plan.planner import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    OFFLOADED_SNAPSHOTS_PER_RUNNING_REQUEST,
    PlanRequest,
    resolve,
)

OFFLOADED_MAX_RUNNING_REQUESTS = 8
KV_FLOOR_SHARE = 32
MIN_CONTEXT = 8192
# a prompt chunk longer than this is priced only where prompts that long are expected (long_prompts_expected)
LONG_PROMPT_TOKENS = 16384


def server_defaults(spec: ModelSpec, req: PlanRequest) -> PlanRequest:
    """`req` with the defaults of a card that holds every expert filled in."""
    return dataclasses.replace(
        req,
        max_running_requests=_given(req.max_running_requests, DEFAULT_MAX_RUNNING_REQUESTS),
        max_model_len=_given(req.max_model_len, spec.max_position_embeddings),
    )


def offloaded_defaults(spec: ModelSpec, req: PlanRequest, budget: int) -> PlanRequest:
    """`req` with a single user's defaults filled in, for a plan that offloads experts under `budget` bytes."""
    max_model_len = req.max_model_len
    if max_model_len is None:
        max_model_len = spec.max_position_embeddings
        if not _kv_flag(req):
            max_model_len = fitted_context(spec, req, budget)
    return dataclasses.replace(
        req,
        max_running_requests=_given(req.max_running_requests, OFFLOADED_MAX_RUNNING_REQUESTS),
        max_model_len=max_model_len,
        snapshots_per_running_request=OFFLOADED_SNAPSHOTS_PER_RUNNING_REQUEST,
    )


def shrunk_defaults(spec: ModelSpec, user: PlanRequest, chosen: PlanRequest) -> PlanRequest | None:
    """The next smaller defaults where `chosen` did not fit: the running requests and the context (each only where
    no flag gave it) halved, the context not under MIN_CONTEXT; None where neither can shrink."""
    mrr, mml = chosen.max_running_requests, chosen.max_model_len
    if user.max_running_requests is None and mrr > 1:
        mrr //= 2
    if user.max_model_len is None and not _kv_flag(user) and mml > MIN_CONTEXT:
        mml = max(MIN_CONTEXT, mml // 2)
    if (mrr, mml) == (chosen.max_running_requests, chosen.max_model_len):
        return None
    return dataclasses.replace(chosen, max_running_requests=mrr, max_model_len=mml)


def fitted_context(spec: ModelSpec, req: PlanRequest, budget: int) -> int:
    """The longest context whose one sequence's KV takes at most 1/KV_FLOOR_SHARE of `budget`: the model's
    own where it does, else the largest power of two that does, never under MIN_CONTEXT (nor the model's)."""
    r = resolve(spec, req)
    per_token = L.kv_bytes_per_token(spec, r.dtype, r.kv_cache_dtype)
    longest = spec.max_position_embeddings
    share = budget // KV_FLOOR_SHARE
    if longest * per_token <= share or longest <= MIN_CONTEXT:
        return longest
    tokens = MIN_CONTEXT
    while tokens * 2 <= longest and tokens * 2 * per_token <= share:
        tokens *= 2
    return tokens


def sizing_source(user: PlanRequest, offloaded: bool) -> str:
    """How the plan's running requests and context were set, for the table and the log."""
    filled = [name for name in ("max_running_requests", "max_model_len") if getattr(user, name) is None]
    if not filled:
        return "--max-running-requests and --max-model-len"
    if offloaded:
        why = (
            "chosen from memory for a card that offloads experts: each running request's state and the KV "
            "floor would be expert slots"
        )
    else:
        why = "a server's defaults: every expert has a slot with them"
    return f"{' and '.join(filled)} {why}; --max-running-requests, --max-model-len to change"


def long_prompts_expected(spec: ModelSpec, user: PlanRequest) -> bool:
    """A prompt chunk past LONG_PROMPT_TOKENS pays only for prompts longer than it, which the user asks for by
    a long --max-model-len or a KV pool (--num-tokens, --num-pages, --kv-reserve-tokens) that holds one."""
    page_size = resolve(spec, user).page_size
    kv_tokens = [user.num_tokens, user.kv_reserve_tokens, user.num_pages * page_size if user.num_pages else None]
    asked = [t for t in (user.max_model_len, *kv_tokens) if t is not None]
    return any(t > LONG_PROMPT_TOKENS for t in asked)


def _kv_flag(req: PlanRequest) -> bool:
    return req.num_tokens is not None or req.num_pages is not None or req.kv_reserve_tokens is not None


def _given(value: int | None, default: int) -> int:
    return default if value is None else value
