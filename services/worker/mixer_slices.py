"""A long step's token mixers in slices (docs/ARCHITECTURE.md §2, "The prefill chunk").

A step of more than `plan.costs.MIXER_SLICE_TOKENS` new tokens runs each layer's token mixer (attention or
Gated DeltaNet) over consecutive slices of its tokens, one after another, and the layer's MoE block over all
of them at once. With experts offloaded a MoE layer costs one pass over the experts without a slot per step,
whatever its tokens, so a long step streams less per prompt token; the mixers gain nothing from more than
8,192 rows, and their intermediates, the largest of a layer, stay those of one slice.

The slice length is the layer's: a sliding layer whose K/V live in rings (plan/kv_groups.py) runs over slices
of at most the tokens its ring holds besides the window (`rows_only`: only a step giving some request more than
that is cut, so decode steps never are), each slice writing its K/V before it attends and before the next
slice writes.

A slice is itself a step (a StepBatch) over the parts of the rows that fall in it: a row cut by a slice
boundary continues in the next slice as a later chunk of the same request would, from its context plus the
tokens before the cut, so the slices compute what two steps would. A row's linear state is zeroed in the
slice where the row begins, and a state kept inside a row's chunk (StepBatch.save_offset) is kept by the
slice it falls in; a cut is never placed exactly at such a point (it moves a token), so the point always lies
strictly inside a slice's part of the row, where the Gated DeltaNet keeps inside states.

The slices only mix tokens: nothing samples (no logits rows), and the step's own state copies (restores
before the forward, saves at the rows' ends after it) stay the whole step's. No torch here."""

from __future__ import annotations

import msgspec
import numpy as np

from ferry.shared.step import StepBatch


def slice_bounds(step: StepBatch, max_tokens: int) -> list[tuple[int, int]]:
    """[(start, end)) token ranges of at most `max_tokens` covering the step's tokens in order, as even as they
    can be (9,000 tokens: two of 4,500, not 8,192 and 808, whose short tail would run every mixer again for
    little), and no cut at a point where a row keeps its state inside its chunk: such a cut moves a token
    either way, or the step takes one slice more."""
    if max_tokens < 2:
        raise ValueError(f"a mixer slice needs at least 2 tokens, got {max_tokens}")
    total = int(np.asarray(step.query_lens).sum())
    starts = np.concatenate([[0], np.cumsum(step.query_lens)[:-1]]).astype(np.int64)
    inside = step.saved_inside()
    points = set((starts[inside] + np.asarray(step.save_offset)[inside]).tolist()) if inside.any() else set()
    for n in range(-(-total // max_tokens), total + 1):
        cuts = _cuts(total, n, max_tokens, points)
        if cuts is not None:
            return list(zip([0, *cuts], [*cuts, total]))
    raise ValueError(f"no slices of at most {max_tokens} tokens avoid the step's kept points")  # every token one


def _cuts(total: int, n: int, max_tokens: int, points: set[int]) -> list[int] | None:
    """The n - 1 cuts of n even slices, each moved off a kept point by a token if it falls on one; None where
    that makes a slice empty or longer than max_tokens."""
    cuts = []
    for i in range(1, n):
        even = i * total // n
        cut = next((c for c in (even, even - 1, even + 1) if c not in points), None)
        if cut is None:
            return None
        cuts.append(cut)
    sizes = np.diff([0, *cuts, total])
    return cuts if len(sizes) and sizes.min() >= 1 and sizes.max() <= max_tokens else None


def mixer_slices(step: StepBatch, max_tokens: int, rows_only: bool = False) -> list[tuple[int, int, StepBatch]]:
    """[(start, end, the slice's step)]: the step cut as slice_bounds says; [] when it needs no cut: at most
    `max_tokens` in all, or with `rows_only` at most that many in each row."""
    lens = np.asarray(step.query_lens)
    if (lens.max(initial=0) if rows_only else int(lens.sum())) <= max_tokens:
        return []
    return [(a, b, _slice(step, a, b)) for a, b in slice_bounds(step, max_tokens)]


def _slice(step: StepBatch, a: int, b: int) -> StepBatch:
    """The part of `step` in tokens [a, b)."""
    qlens = np.asarray(step.query_lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(qlens)[:-1]])
    ends = starts + qlens
    rows = np.flatnonzero((starts < b) & (ends > a))
    part_start = np.maximum(starts[rows], a)
    part_end = np.minimum(ends[rows], b)
    save_state = save_offset = None
    inside = step.saved_inside()[rows]
    if inside.any():
        point = starts[rows] + np.asarray(step.save_offset, dtype=np.int64)[rows]
        here = inside & (point > part_start) & (point < part_end)
        save_state = np.where(here, np.asarray(step.save_state)[rows], -1).astype(np.int32)
        save_offset = np.where(here, point - part_start, part_end - part_start).astype(np.int32)
    return msgspec.structs.replace(
        step,
        req_ids=np.asarray(step.req_ids)[rows],
        tokens=np.asarray(step.tokens)[a:b],
        query_lens=(part_end - part_start).astype(np.int32),
        context_lens=(np.asarray(step.context_lens, dtype=np.int64)[rows] + part_start - starts[rows]).astype(np.int32),
        page_table=np.asarray(step.page_table)[rows],
        linear_state_slots=np.asarray(step.linear_state_slots)[rows],
        reset_linear_state=np.asarray(step.reset_linear_state)[rows] & (starts[rows] >= a),
        sample=np.zeros(len(rows), dtype=bool),
        new_requests=(),
        finished_req_ids=(),
        prompt_logprobs=None,
        feed_sampled=None,
        restore_state=None,
        save_state=save_state,
        save_offset=save_offset,
        draft_lens=None,  # the slices sample nothing: the whole step's logits rows are the step's
        hold_state=None,  # held and put back around the whole step
    )
