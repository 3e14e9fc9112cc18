"""The contract's checks on what a process receives: each returns what is wrong (a message naming the
field) or nothing, and costs a few numpy reductions over arrays the size of one step. No torch.

The wire (shared/wire.py, msgspec constraints in messages.py) already refused what is not a message of
the socket's union or holds an integer out of its range; these check what a well-formed message may
still get wrong: array dtypes and shapes, token ids against the vocabulary, indices against the pools
(docs/ARCHITECTURE.md §1, "Trust"). A problem found here is answered for the one request (or step)
it concerns; nothing raises past the receiving loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ferry.shared.sampling import MAX_LOGPROBS, SamplingParams, sampling_problems
from ferry.shared.speculation import MAX_SPECULATIVE_TOKENS, speculates

# a step's measured device seconds (StepOutput.decode_step_s, chain_position_s, verify_step_s) beyond this are not a
# measurement
STEP_SECONDS_LIMIT = 3600.0
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _is_ints(a: np.ndarray) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.kind in "iu"


def token_ids_problem(name: str, ids: np.ndarray, vocab_size: int) -> str | None:
    """A 1-D integer array of token ids, each in 0..vocab_size-1 (vocab_size 0: not checked)."""
    if not _is_ints(ids) or ids.ndim != 1:
        kind = ids.dtype if isinstance(ids, np.ndarray) else type(ids).__name__
        shape = getattr(ids, "shape", "?")
        return f"{name} must be a 1-D array of integer token ids, got {kind} of shape {shape}"
    if ids.size and (int(ids.min()) < 0 or (vocab_size and int(ids.max()) >= vocab_size)):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        return f"{name}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
    return None


def sampling_wire_problems(p: SamplingParams, vocab_size: int = 0) -> list[str]:
    """shared/sampling.py's rules (ranges, including logit_bias, the logprobs counts and the grammar's
    size), plus what only a forged message can get wrong: non-finite numbers, and logit_bias token ids
    outside the vocabulary (vocab_size 0: not checked)."""
    problems = [
        f"{f} must be a finite number, got {getattr(p, f)}" for f in _FLOATS if not math.isfinite(getattr(p, f))
    ]
    problems = problems or sampling_problems(p)
    if not problems and vocab_size and p.logit_bias:
        bad = max(t for t, _ in p.logit_bias)
        if bad >= vocab_size:
            problems.append(f"logit_bias: token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return problems


@dataclass(frozen=True)
class StepLimits:
    """What the worker's plan allows a step (the worker checks every RunStep against them)."""

    kv_pages: int
    page_size: int
    linear_state_slots: int  # 0: the model has no linear attention (slots are then ignored)
    max_running_requests: int
    max_prefill_tokens: int
    max_model_len: int
    vocab_size: int
    linear_state_snapshots: int = 0  # snapshot ids 0..this-1 (hybrid models' prefix cache); 0: none
    kv_ring_slots: int = 0  # the sliding KV groups' rings (plan/kv_groups.py) are for slots 0..this; 0: none


_ARRAYS = {
    "req_ids": "iu",
    "tokens": "iu",
    "query_lens": "iu",
    "context_lens": "iu",
    "page_table": "iu",
    "linear_state_slots": "iu",
    "reset_linear_state": "b",
    "sample": "b",
}


def step_problems(batch, limits: StepLimits, known: set[int] | dict) -> list[str]:
    """What is wrong with a StepBatch for this worker: dtypes and shapes, the plan's limits, token ids,
    page and slot ids, and request ids (a request that samples must be known or announced in this step)."""
    problems: list[str] = []
    for name, kinds in _ARRAYS.items():
        a = getattr(batch, name)
        if not isinstance(a, np.ndarray) or a.dtype.kind not in kinds:
            problems.append(f"{name} has dtype {getattr(a, 'dtype', type(a).__name__)}")
        elif a.ndim != (2 if name == "page_table" else 1):
            problems.append(f"{name} has {a.ndim} dimensions")
    # optional bool [R] rows: whose next tokens' logprobs are wanted; whose token is the one sampled in the step before
    optional = {name: getattr(batch, name) for name in ("prompt_logprobs", "feed_sampled")}
    for name, a in optional.items():
        if a is not None and (not isinstance(a, np.ndarray) or a.dtype.kind != "b" or a.ndim != 1):
            problems.append(
                f"{name} must be a 1-D bool array, got {getattr(a, 'dtype', type(a).__name__)} "
                f"of shape {getattr(a, 'shape', '?')}"
            )
    # optional int [R] rows: the snapshot each row's state is restored from / saved to (-1: none)
    copies = {
        name: getattr(batch, name, None)
        for name in (
            "restore_state",
            "save_state",
            "save_offset",
            "draft_lens",
            "hold_state",
            "mtp_drafts",
            "next_tokens",
        )
    }
    for name, a in copies.items():
        if a is not None and (not _is_ints(a) or a.ndim != 1):
            problems.append(
                f"{name} must be a 1-D integer array, got {getattr(a, 'dtype', type(a).__name__)} "
                f"of shape {getattr(a, 'shape', '?')}"
            )
    if problems:
        return problems
    r, t = len(batch.req_ids), len(batch.tokens)
    for name, a in {**optional, **copies}.items():
        if a is not None and len(a) != r:
            problems.append(f"{name} has {len(a)} entries for {r} requests")
    q = batch.query_lens.astype(np.int64)
    if int(q.sum()) != t or (q < 1).any():
        problems.append(f"query_lens do not split {t} tokens into {r} non-empty chunks")
    if t > limits.max_prefill_tokens:
        problems.append(f"{t} tokens exceed max_prefill_tokens {limits.max_prefill_tokens}")
    if r > limits.max_running_requests:
        problems.append(f"{r} requests exceed max_running_requests {limits.max_running_requests}")
    for name in ("query_lens", "context_lens", "linear_state_slots", "reset_linear_state", "sample"):
        if len(getattr(batch, name)) != r:
            problems.append(f"{name} has {len(getattr(batch, name))} entries for {r} requests")
    if len(np.unique(batch.req_ids)) != r:
        problems.append("a request appears twice")
    feed, marks = batch.feed_sampled, batch.prompt_logprobs
    if not problems and feed is not None and feed.any():
        if (
            (batch.query_lens[feed] != 1).any()
            or (batch.context_lens[feed] < 1).any()
            or batch.reset_linear_state[feed].any()
        ):
            problems.append("a feed_sampled row must decode one token of a request already started")
    if (bad := token_ids_problem("tokens", batch.tokens, limits.vocab_size)) is not None:
        problems.append(bad)
    if problems:
        return problems
    ctx = batch.context_lens.astype(np.int64)
    if r and ((ctx < 0).any() or int((ctx + q).max()) > limits.max_model_len):
        problems.append(f"positions must lie in 0..{limits.max_model_len - 1}")
    pt = batch.page_table
    if pt.shape[0] != r:
        problems.append(f"page_table has shape {pt.shape}, expected ({r}, max_pages)")
    elif pt.size and (int(pt.min()) < 0 or int(pt.max()) > limits.kv_pages):
        problems.append(f"page ids must be in 0..{limits.kv_pages}")
    elif r and (-(-(ctx + q) // limits.page_size) > pt.shape[1]).any():
        problems.append("a request's tokens run past the pages in its page_table row")
    slots = batch.linear_state_slots
    slot_limit = max(limits.linear_state_slots, limits.kv_ring_slots)  # a request's one slot serves both
    if slot_limit and slots.size and (int(slots.min()) < 0 or int(slots.max()) > slot_limit):
        problems.append(f"linear-state slots must be in 0..{slot_limit}")
    problems += _state_copy_problems(
        batch, {k: copies[k] for k in ("restore_state", "save_state", "hold_state")}, limits
    )
    announced = {}
    for new in batch.new_requests:
        announced[new.req_id] = new.sampling
        if bad := token_ids_problem(f"request {new.req_id}'s prompt", new.prompt_token_ids, limits.vocab_size):
            problems.append(bad)
        problems += [f"request {new.req_id}: {p}" for p in sampling_wire_problems(new.sampling, limits.vocab_size)]
    forgotten = set(batch.finished_req_ids)
    # rows that sample or want prompt logprobs use the request's sampler state: it must exist
    uses_state = batch.sample if marks is None else batch.sample | marks
    for rid in batch.req_ids[uses_state].tolist():
        if rid not in announced and (rid not in known or rid in forgotten):
            problems.append(f"request {rid} samples (or wants prompt logprobs) but was never announced (no NewRequest)")
            break
    if not problems and (batch.draft_lens is not None or batch.hold_state is not None):
        problems += _draft_problems(batch, known, announced, hybrid=limits.linear_state_slots > 0)
    if not problems and (batch.mtp_drafts is not None or batch.next_tokens is not None):
        problems += _mtp_problems(batch, limits)
    return problems


def _mtp_problems(batch, limits: StepLimits) -> list[str]:
    """--speculative-method mtp's rows (services/worker/mtp_drafts.py): drafts asked of sampling rows only, at most
    MAX_SPECULATIVE_TOKENS, their chain's K/V (from the row's last position on) within its pages and the model
    length; a next token given to rows that do not sample only, -1 or a token of the vocabulary."""
    r = len(batch.req_ids)
    end = batch.context_lens.astype(np.int64) + batch.query_lens.astype(np.int64)
    if batch.mtp_drafts is not None:
        k = batch.mtp_drafts.astype(np.int64)
        if (k < 0).any() or (k > MAX_SPECULATIVE_TOKENS).any() or (k[~batch.sample.astype(bool)] != 0).any():
            return [f"mtp_drafts: 0..{MAX_SPECULATIVE_TOKENS} drafts, asked of sampling rows only"]
        reach = end + np.maximum(k - 1, 0)  # the chain writes K/V up to k - 1 positions past the row's last
        pages = -(-reach // limits.page_size)
        if r and (int(reach.max()) > limits.max_model_len or (pages > batch.page_table.shape[1]).any()):
            return ["mtp_drafts: a row's draft chain runs past its pages or the model length"]
    if batch.next_tokens is not None:
        nxt = batch.next_tokens.astype(np.int64)
        if (nxt[batch.sample.astype(bool)] != -1).any() or (nxt < -1).any():
            return ["next_tokens: -1 for sampling rows, a token or -1 for the others"]
        if limits.vocab_size and (nxt >= limits.vocab_size).any():
            return [f"next_tokens must lie in 0..{limits.vocab_size - 1} (or -1)"]
    return []


def _draft_problems(batch, known: set[int] | dict, announced: dict, hybrid: bool) -> list[str]:
    """A step's drafting rows (shared/speculation.py): fewer drafts than the row's tokens, on a row that
    samples, saves no state and is not fed, of a request whose sampling allows speculation; on a hybrid model
    each holds its state in a snapshot of its own, which no row of the step saves into (hold_state)."""
    r = len(batch.req_ids)
    d = np.zeros(r, np.int64) if batch.draft_lens is None else batch.draft_lens.astype(np.int64)
    rows = d > 0
    hold = np.full(r, -1, np.int64) if batch.hold_state is None else batch.hold_state.astype(np.int64)
    held = hold[hold >= 0]
    saved = set() if batch.save_state is None else set(batch.save_state[batch.save_state >= 0].tolist())
    if ((hold >= 0) != (rows & hybrid)).any():
        return ["hold_state: a hybrid model's drafting rows, and only they, hold their state in a snapshot"]
    if len(np.unique(held)) != held.size or saved & set(held.tolist()):
        return ["hold_state: each row holds its state in a snapshot of its own, which no row saves into"]
    if (d < 0).any() or (d >= batch.query_lens).any():
        return ["draft_lens: a row's drafts must be fewer than its tokens (0 for a row without drafts)"]
    fed = batch.feed_sampled[rows].any() if batch.feed_sampled is not None else False
    saves = (batch.save_state[rows] >= 0).any() if batch.save_state is not None else False
    if not batch.sample[rows].all() or fed or saves:
        return ["draft_lens: a drafting row must sample, be not fed and save no linear state"]
    for rid in batch.req_ids[rows].tolist():
        params = announced.get(rid)
        if params is None and isinstance(known, dict) and rid in known:
            params = known[rid].params
        if params is not None and not speculates(params):
            return [f"draft_lens: request {rid}'s sampling (penalties, a grammar, logprobs or a seed) cannot speculate"]
    return []


def _state_copy_problems(batch, copies: dict, limits: StepLimits) -> list[str]:
    """The linear-state snapshot ids of a step's state copies (shared/step.py): in the snapshot pool,
    between a snapshot and a real slot, a restore only into a request that starts from a cached prefix
    (context > 0, no reset, not fed), and never two saves into one snapshot in a step."""
    problems: list[str] = []
    n = limits.linear_state_snapshots if limits.linear_state_slots else 0
    for name, a in copies.items():
        if a is None or len(a) != len(batch.req_ids):
            continue  # the length was reported above
        used = a[a != -1]
        if used.size == 0:
            continue
        if int(used.min()) < 0 or int(used.max()) >= n:
            problems.append(
                f"{name}: snapshot ids must be -1 or in 0..{n - 1}"
                if n
                else f"{name}: this worker keeps no linear-state snapshots"
            )
            continue
        rows = a != -1
        if (batch.linear_state_slots[rows] < 1).any():
            problems.append(f"{name}: a row copying a snapshot must hold a linear-state slot (1..)")
        if name == "save_state" and len(np.unique(used)) != used.size:
            problems.append("save_state: two rows save into one snapshot")
        if name == "save_state" and batch.save_offset is not None and len(batch.save_offset) == len(a):
            off = batch.save_offset[rows].astype(np.int64)
            if (off < 1).any() or (off > batch.query_lens[rows]).any():
                problems.append("save_offset: a saving row's offset must be in 1..its query_lens")
        if name == "restore_state":
            fed = batch.feed_sampled[rows].any() if batch.feed_sampled is not None else False
            if (batch.context_lens[rows] < 1).any() or batch.reset_linear_state[rows].any() or fed:
                problems.append(
                    "restore_state: a restored row must start from a cached prefix (context > 0, "
                    "no state reset, not fed)"
                )
    return problems


def _is_floats(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.kind == "f"


def logprobs_problem(lp, vocab_size: int = 0) -> str | None:
    """A Logprobs' arrays (shared/step.py): float token_logprobs [n >= 1], integer top_ids and float
    top_logprobs [n, k] with k at most MAX_LOGPROBS, and top ids in the vocabulary (vocab_size 0: not
    checked). The values themselves may be anything a float holds (-inf: a token the model rules out)."""
    where = f"request {lp.req_id}'s logprobs"
    vals, ids, tops = lp.token_logprobs, lp.top_ids, lp.top_logprobs
    if not _is_floats(vals) or vals.ndim != 1 or len(vals) < 1:
        return f"{where}: token_logprobs must be a non-empty 1-D float array"
    if (
        not _is_ints(ids)
        or not _is_floats(tops)
        or ids.ndim != 2
        or ids.shape != tops.shape
        or ids.shape[0] != len(vals)
    ):
        return f"{where}: top_ids and top_logprobs must be integer and float arrays of shape ({len(vals)}, k)"
    if ids.shape[1] > MAX_LOGPROBS:
        return f"{where}: {ids.shape[1]} top alternatives; at most {MAX_LOGPROBS}"
    if ids.size and (int(ids.min()) < 0 or (vocab_size and int(ids.max()) >= vocab_size)):
        return f"{where}: a top token id is outside the vocabulary"
    return None


def step_output_problem(output, vocab_size: int = 0) -> str | None:
    """A StepOutput's arrays: 1-D integer req_ids and token_ids of one length (the scheduler then
    checks each request's token on its own); its logprobs well-formed, the sampled ones one position
    each, for requests that sampled in this step."""
    ids, toks = output.req_ids, output.token_ids
    if not _is_ints(ids) or not _is_ints(toks) or ids.ndim != 1 or toks.ndim != 1 or len(ids) != len(toks):
        return "a step's output must hold 1-D integer req_ids and token_ids of one length"
    for lp in (*output.sampled_logprobs, *output.prompt_logprobs):
        if (problem := logprobs_problem(lp, vocab_size)) is not None:
            return problem
    if output.sampled_logprobs:
        sampled = set(ids.tolist())
        for lp in output.sampled_logprobs:
            if lp.req_id not in sampled or len(lp.token_logprobs) != 1:
                return f"request {lp.req_id}'s sampled logprobs must describe the one token it sampled in this step"
    acc = output.accepted_drafts
    if acc is not None and (not _is_ints(acc) or acc.ndim != 1 or len(acc) != len(ids) or (acc < 0).any()):
        return "a step's accepted_drafts must hold one count (>= 0) for each request that sampled"
    drafts = output.mtp_drafts
    if drafts is not None and (
        not _is_ints(drafts)
        or drafts.ndim != 2
        or len(drafts) != len(ids)
        or (drafts < -1).any()
        or (vocab_size and (drafts >= vocab_size).any())
    ):
        return "a step's mtp_drafts must hold a row of draft tokens (or -1) for each request that sampled"
    for name in ("decode_step_s", "chain_position_s", "verify_step_s"):
        seconds = getattr(output, name)
        if not math.isfinite(seconds) or not 0.0 <= seconds < STEP_SECONDS_LIMIT:
            return f"a step's {name} must be seconds, >= 0 and under {STEP_SECONDS_LIMIT:.0f}"
    if output.grammar_failures:
        sampled = set(ids.tolist())
        for req_id, _ in output.grammar_failures:
            if req_id not in sampled:
                return f"request {req_id}'s grammar failure must concern a request that sampled in this step"
    return None
