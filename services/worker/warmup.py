"""Eager steps at boot over the shapes that served steps take, before the server says ready.

Whatever compiles or tunes on first use (a Triton kernel's variant for a new class of arguments,
fla's autotuned Gated DeltaNet kernels, the expert store's prefill path, library handles) then
does so at boot, not inside a request: a variant compiled while eight streams decode stalls every
one of them for the seconds it takes.

The shapes: one row and several, one token per row (eager decode: a starting request, more
rows than the largest decode graph) and several (prefill chunks, mixed steps), token counts in
each of Triton's integer classes (1, a multiple of 16, neither) and of both parities, and one
long enough (300 tokens) that even a 512-expert model streams its prefill through the staging
slots (offload/stores/device_driven.py), within --max-prefill-tokens and --max-running-requests. Each
runs once.

No request is touched: every row writes the sentinel KV page and the padding linear-state slot
(shared/step.py's conventions), and `real_tokens` 0 tells the device-driven expert store that
every row is padding, so no expert is looked up or copied. (The host-driven store ignores
`real_tokens`; there the warm-up's rows are looked up like any step's, which changes only
which experts are resident.) The caller resets the store's statistics afterwards.

A hybrid model with linear-state snapshots in its plan also runs the steps of a prefill that keeps its
state at a point inside its chunk (`save_inside_shapes`: the prefix cache's snapshot points), whose Gated
DeltaNet rule runs in two parts of their own token counts; a first request sharing a system prompt with
others takes that path.

Then a few steps whose rows count as real for the expert store (`REAL_SHAPES`: a one-token decode,
two rows, a 16-token prompt): still on the sentinel page and the padding slot, but their experts are
looked up, missed and copied, so the paths a first request takes through the store (the lookup with
real rows, the graph-safe copy and the host-read one, the unpacking kernels of packed banks) compile
here too. Without them the first 16-token request after "ready" waits for those compiles (over a second).
They change only which experts are resident.
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from ferry.services.worker.forward_batch import ForwardBatch
from ferry.shared.step import StepBatch
from ferry.shared.units import ceil_div

# query_lens of each warm-up step, before the plan's limits trim the list
_SHAPES: tuple[tuple[int, ...], ...] = (
    (1,),
    (2,),
    (3,),
    (16,),
    (17,),
    (64,),
    (65,),
    (300,),
    (1, 1),
    (1, 2),
    (1, 16),
    (8, 8),
    (1, 1, 1),
    (3, 17, 30),
    (1,) * 16,
    (1,) * 17,
    (1,) * 64,
)


# query_lens of the warm-up steps whose rows the expert store treats as real (see the module docstring)
REAL_SHAPES: tuple[tuple[int, ...], ...] = ((1,), (1, 1), (16,))


# A hybrid model's prefill that keeps its state at a point inside its chunk (the prefix cache's snapshot
# points: StepBatch.save_offset) runs the Gated DeltaNet rule in two parts, up to the point and on from it,
# each with a token count of its own: the point on the first page boundary (16 tokens by default), the
# rest 1, a page and a page plus one. Their rows save into the pool's last snapshot, which no request holds
# yet at boot (a snapshot is read only after the scheduler had a step save it).
def save_inside_shapes(page_size: int) -> tuple[tuple[int, ...], ...]:
    return (page_size + 1,), (2 * page_size,), (2 * page_size + 1,)


def _allowed(shapes, max_prefill_tokens: int, max_running_requests: int) -> list[tuple[int, ...]]:
    out = []
    for shape in shapes:
        if len(shape) <= max_running_requests and sum(shape) <= max_prefill_tokens and shape not in out:
            out.append(shape)
    return out


def warmup_shapes(max_prefill_tokens: int, max_running_requests: int) -> list[tuple[int, ...]]:
    """The warm-up steps' query_lens that the plan allows (a step's tokens within
    --max-prefill-tokens, its rows within --max-running-requests), each once."""
    return _allowed(_SHAPES, max_prefill_tokens, max_running_requests)


def real_warmup_shapes(max_prefill_tokens: int, max_running_requests: int) -> list[tuple[int, ...]]:
    """REAL_SHAPES that the plan allows."""
    return _allowed(REAL_SHAPES, max_prefill_tokens, max_running_requests)


def warmup_step(query_lens: tuple[int, ...], page_size: int) -> StepBatch:
    """A step of len(query_lens) starting requests whose every page is the sentinel page, on the
    padding state slot."""
    rows = len(query_lens)
    pages = ceil_div(max(query_lens), page_size)
    return StepBatch(
        step_id=0,
        req_ids=np.arange(rows, dtype=np.int64),
        tokens=np.ones(sum(query_lens), np.int32),
        query_lens=np.asarray(query_lens, np.int32),
        context_lens=np.zeros(rows, np.int32),
        page_table=np.zeros((rows, pages), np.int32),
        linear_state_slots=np.zeros(rows, np.int32),
        reset_linear_state=np.ones(rows, bool),
        sample=np.ones(rows, bool),
    )


def save_inside_step(query_len: int, page_size: int, snapshot: int) -> StepBatch:
    """warmup_step of one row whose state is kept at its first page boundary, into `snapshot`."""
    step = warmup_step((query_len,), page_size)
    return msgspec.structs.replace(
        step, save_state=np.array([snapshot], np.int32), save_offset=np.array([page_size], np.int32)
    )


def warm_up(
    model,
    pools,
    page_size: int,
    device: torch.device,
    shapes: list[tuple[int, ...]],
    real_shapes: list[tuple[int, ...]] = (),
    max_prefill_tokens: int | None = None,
) -> int:
    """Run the model eagerly once on each shape, every row padding for the expert store, then (a hybrid
    model with snapshots in its plan) the steps that keep a state inside their chunk, within
    `max_prefill_tokens`, then once on each of `real_shapes`, whose rows it looks up and copies; returns
    how many steps ran."""
    linear = pools.linear_state
    snapshots = linear.num_snapshots if linear is not None else 0
    inside = [s for s in save_inside_shapes(page_size) if max_prefill_tokens is None or s[0] <= max_prefill_tokens]
    steps = [warmup_step(shape, page_size) for shape in shapes]
    steps += [save_inside_step(s[0], page_size, snapshots - 1) for s in inside] if snapshots else []
    with torch.inference_mode():
        for step in steps:
            batch = ForwardBatch.from_step(step, page_size, device)
            batch.real_tokens.zero_()  # padding for the expert store: nothing looked up, nothing copied
            model(batch, pools)
        for shape in real_shapes:  # real rows for the store; the sentinel page and padding slot still
            model(ForwardBatch.from_step(warmup_step(shape, page_size), page_size, device), pools)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(steps) + len(real_shapes)
