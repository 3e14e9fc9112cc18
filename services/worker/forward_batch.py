"""A StepBatch turned into the device tensors the model's forward reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ferry.plan.costs import MIXER_SLICE_TOKENS
from ferry.services.worker.mixer_slices import mixer_slices
from ferry.shared.step import StepBatch
from ferry.shared.units import round_up

# Every packed array starts on a 16-byte boundary: Triton specialises pointer arguments on 16-byte
# alignment, so an 8-byte layout would make the alignment of (say) `positions` depend on the step's
# token count, and a step of a new parity would compile new kernel variants in the middle of serving.
PACK_ALIGN = 16


@dataclass
class ForwardBatch:
    """Tensors for one forward over R requests and T new tokens (see shared/step.py for meanings).

    `slot_mapping[t]` is the flat KV row (page * page_size + offset) that token t writes;
    `logits_rows` are the token rows whose logits are needed (the last new token of every
    request that samples; a drafting row's last draft_lens + 1 tokens: shared/step.py). Host
    copies of the small per-request arrays are kept too, because CPU reference paths loop over
    requests.

    All device arrays are views of one buffer that crosses to the device in a single copy (from
    pinned memory on CUDA): ten small copies were ten launches and ten driver calls per step."""

    tokens: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    query_start: torch.Tensor  # int32 [R + 1]
    query_lens: torch.Tensor  # int32 [R]
    context_lens: torch.Tensor  # int32 [R]
    page_table: torch.Tensor  # int32 [R, max_pages]
    slot_mapping: torch.Tensor  # int64 [T]
    state_slots: torch.Tensor  # int64 [R]
    reset_state: torch.Tensor  # bool [R]
    logits_rows: torch.Tensor  # int64 [S]
    token_request: torch.Tensor  # int32 [T]: the request of every new token (attention kernels)
    real_tokens: torch.Tensor  # int32 [1]: T, or fewer in a CUDA graph's padded batch (rows past it are padding)
    sample_mask: np.ndarray  # bool [R] (host)
    query_lens_host: list[int]
    context_lens_host: list[int]
    # the rows' linear-state slots on the host too (padding rows: the padding slot 0): a linear layer that
    # needs them as a list must not read `state_slots` back, a device synchronisation every layer
    state_slots_host: list[int]
    page_size: int
    # (row, tokens of the row before it, snapshot id): the rows whose linear state is saved inside their
    # chunk (StepBatch.save_offset), by the linear layers during the forward (host data; prefill steps only)
    inside_saves: tuple[tuple[int, int, int], ...] = ()
    # the linear-state slots of the rows that start in this step (zeroed first), on the host: a mask over the
    # device's `state_slots` would make the host wait for the device
    fresh_slots_host: tuple[int, ...] = ()
    # the host step the batch was made of, whose slices `slices` cuts (None: a padded decode step, never cut)
    step: StepBatch | None = None
    device: torch.device | None = None
    _slices: dict = field(default_factory=dict, repr=False)

    def slices(
        self, max_tokens: int | None = None, rows_only: bool = False
    ) -> tuple[tuple[int, int, "ForwardBatch"], ...]:
        """(start, end, the slice's batch) for each slice of at most `max_tokens` (MIXER_SLICE_TOKENS where None)
        of the step's tokens, which a layer's token mixer runs over one after another; () where the step needs
        no cut (services/worker/mixer_slices.py, `rows_only` as there). Made at a layer's first ask, then kept."""
        key = (MIXER_SLICE_TOKENS if max_tokens is None else max_tokens, rows_only)
        if key not in self._slices:
            parts = mixer_slices(self.step, *key) if self.step is not None else []
            self._slices[key] = tuple(
                (a, b, ForwardBatch.from_step(p, self.page_size, self.device)) for a, b, p in parts
            )
        return self._slices[key]

    @property
    def mixer_slices(self) -> tuple[tuple[int, int, "ForwardBatch"], ...]:
        """The slices every token mixer but a ring layer runs over: those of MIXER_SLICE_TOKENS."""
        return self.slices()

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @classmethod
    def from_step(
        cls,
        step: StepBatch,
        page_size: int,
        device: torch.device | str,
        pad_to: int | None = None,
        max_pages: int | None = None,
        into: torch.Tensor | None = None,
        row_tokens: int = 1,
    ) -> "ForwardBatch":
        """The step's tensors on `device`. For a CUDA graph's fixed shapes (steps whose every row has
        `row_tokens` tokens and samples: a decode step's one, a verify step's drafts; every position's
        logits kept), `pad_to` rows and `max_pages` page-table columns, written `into` the graph's static
        input buffer (its layout is the same for every step of that shape). Padding rows are harmless by
        the index conventions of shared/step.py: their tokens 0, all at position 0 of the sentinel page, the
        padding state slot, and `real_tokens` tells the expert store to leave them out. A step not padded
        keeps its host step, which its mixers' slices are cut from."""
        qlens = step.query_lens.astype(np.int64)
        clens = step.context_lens.astype(np.int64)
        qstart = np.zeros(len(qlens) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qstart[1:])
        # positions of every new token, and the KV row each writes
        req_of_token = np.repeat(np.arange(len(qlens)), qlens)
        positions = clens[req_of_token] + (np.arange(qstart[-1]) - qstart[req_of_token])
        pages = step.page_table[req_of_token, positions // page_size].astype(np.int64)
        slot_mapping = pages * page_size + positions % page_size
        logits_rows = (qstart[1:] - 1)[step.sample.astype(bool)]
        if step.draft_lens is not None:  # a drafting row: each of its last draft_lens + 1 positions, in order
            ends = qstart[1:][step.sample.astype(bool)]
            span = step.draft_lens.astype(np.int64)[step.sample.astype(bool)] + 1
            logits_rows = np.repeat(ends - span, span) + _ranges(span)
        arrays = dict(
            tokens=(step.tokens, np.int64),
            positions=(positions, np.int64),
            slot_mapping=(slot_mapping, np.int64),
            state_slots=(step.linear_state_slots, np.int64),
            logits_rows=(logits_rows, np.int64),
            query_start=(qstart, np.int32),
            query_lens=(qlens, np.int32),
            context_lens=(clens, np.int32),
            page_table=(step.page_table, np.int32),
            token_request=(req_of_token, np.int32),
            reset_state=(step.reset_linear_state, np.bool_),
            real_tokens=(np.array([qstart[-1]]), np.int32),
        )
        rows = len(qlens)
        if pad_to is not None:
            if not step.sample.all():
                raise ValueError("only steps whose every request samples are padded for a graph")
            arrays = _padded_rows(arrays, rows, pad_to, max_pages, row_tokens)
            rows = pad_to
        pad = rows - len(qlens)
        inside = tuple(
            (int(i), int(step.save_offset[i]), int(step.save_state[i])) for i in np.flatnonzero(step.saved_inside())
        )
        if inside and pad_to is not None:
            raise ValueError("a graph's step saves no state inside a row")
        return cls(
            **_to_device_in_one_copy(arrays, torch.device(device), into),
            sample_mask=np.concatenate([step.sample.astype(bool), np.ones(pad, bool)]),
            query_lens_host=qlens.tolist() + [row_tokens] * pad,
            context_lens_host=clens.tolist() + [0] * pad,
            state_slots_host=np.asarray(step.linear_state_slots, dtype=np.int64).tolist() + [0] * pad,
            page_size=page_size,
            inside_saves=inside,
            fresh_slots_host=tuple(int(slot) for slot in np.asarray(step.linear_state_slots)[step.reset_linear_state]),
            step=step if pad_to is None else None,
            device=torch.device(device),
        )


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each n of `lengths`, concatenated."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum())) - starts


def _padded_rows(arrays: dict, rows: int, pad_to: int, max_pages: int, row_tokens: int = 1) -> dict:
    """A graph's step arrays (every request `row_tokens` new tokens, every request sampling) padded to
    `pad_to` rows and a `max_pages`-wide page table, every position's logits kept."""
    n = row_tokens
    if rows > pad_to or arrays["page_table"][0].shape[1] > max_pages:
        raise ValueError(
            f"a step of {rows} requests and {arrays['page_table'][0].shape[1]} pages does not fit "
            f"a graph of {pad_to} rows and {max_pages} pages"
        )
    if (arrays["query_lens"][0] != n).any():
        raise ValueError(f"only steps of {n} token(s) a request are padded to {n} a row")
    extra = pad_to - rows

    def tail(name, per_row=1):
        a = np.asarray(arrays[name][0])
        return np.concatenate([a, np.zeros(extra * per_row, dtype=a.dtype)]), arrays[name][1]

    # a padding row's tokens: token 0, all at position 0 of the sentinel page (page 0), the padding state slot 0
    out = {name: tail(name, n) for name in ("tokens", "positions", "slot_mapping")}
    out |= {name: tail(name) for name in ("state_slots", "context_lens", "reset_state")}
    out["query_lens"] = (np.full(pad_to, n, np.int64), np.int32)
    out["query_start"] = (np.arange(pad_to + 1) * n, np.int32)
    out["token_request"] = (np.repeat(np.arange(pad_to), n), np.int32)
    out["logits_rows"] = (np.arange(pad_to * n), np.int64)
    table = np.zeros((pad_to, max_pages), dtype=np.int32)
    pt = arrays["page_table"][0]
    table[: pt.shape[0], : pt.shape[1]] = pt
    out["page_table"] = (table, np.int32)
    out["real_tokens"] = arrays["real_tokens"]
    return {name: out[name] for name in arrays}  # the same order, so the same layout every step


def _to_device_in_one_copy(
    arrays: dict[str, tuple[np.ndarray, type]], device: torch.device, into: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """{name: device tensor} for {name: (array, numpy dtype)}: packed into one byte buffer (each
    array at an offset aligned to PACK_ALIGN bytes), copied once, into `into` when given (it must
    have exactly the packed size)."""
    layout, offset = {}, 0
    for name, (a, dtype) in arrays.items():
        a = np.ascontiguousarray(a, dtype=dtype)
        layout[name] = (a, offset)
        offset += round_up(a.nbytes, PACK_ALIGN)
    host = torch.empty(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = host.numpy()
    for a, start in layout.values():
        staging[start : start + a.nbytes] = a.reshape(-1).view(np.uint8)
    if into is None:
        packed = host.to(device, non_blocking=True)
    else:
        if into.numel() != offset:
            raise ValueError(f"the static input buffer has {into.numel()} bytes, the step packs {offset}")
        packed = into.copy_(host, non_blocking=True)
    out = {}
    for name, (a, start) in layout.items():
        dtype = torch.from_numpy(a[:0]).dtype
        out[name] = packed[start : start + a.nbytes].view(dtype).view(a.shape)
    return out
