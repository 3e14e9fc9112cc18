"""A graph-replayed decode step's inputs and results, through pinned host buffers made once.

A decode step costs the host what it takes to put its inputs on the device, replay the graph and bring the sampled
tokens back. Building each step's arrays anew (numpy temporaries, a pinned allocation per tensor, a copy each) cost
more host time than the device took for the whole step. Here every graph bucket has a ring of pinned buffers laid
out exactly like its static input buffer (`decode_layout`, the same packing as forward_batch.py's one-copy upload),
written in place: the per-step values only, the constant index arrays once. Beside the forward's arrays the layout
carries what the graph's own tail reads (decode_graphs.py): each row's inverse temperature and noise row for the
sampler, and the row of the previous step's samples that feeds it (-1: its token is in `tokens`). Results come back
the same way: one copy of the graph's packed [tokens | logprobs] into a pinned ring slot.

Ring slots are reused only once the copy that read (or wrote) them is done, by its event: with a
step running and one scheduled ahead, a ring of RING_DEPTH never waits in practice.
"""

from __future__ import annotations

import numpy as np
import torch

from ferry.services.worker.forward_batch import PACK_ALIGN
from ferry.shared.step import StepBatch
from ferry.shared.units import round_up

RING_DEPTH = 4

# The forward's arrays in forward_batch.py's packing order, then the graph tail's; (name, numpy dtype, shape kind)
FORWARD_FIELDS = (
    ("tokens", np.int64, "r"),
    ("positions", np.int64, "r"),
    ("slot_mapping", np.int64, "r"),
    ("state_slots", np.int64, "r"),
    ("logits_rows", np.int64, "r"),
    ("query_start", np.int32, "r+1"),
    ("query_lens", np.int32, "r"),
    ("context_lens", np.int32, "r"),
    ("page_table", np.int32, "r,p"),
    ("token_request", np.int32, "r"),
    ("reset_state", np.bool_, "r"),
    ("real_tokens", np.int32, "1"),
)
TAIL_FIELDS = (("inv_temperature", np.float32, "r"), ("noise_rows", np.int64, "r"), ("feed_src", np.int64, "r"))


def _shape(kind: str, rows: int, max_pages: int) -> tuple[int, ...]:
    return {"r": (rows,), "r+1": (rows + 1,), "r,p": (rows, max_pages), "1": (1,)}[kind]


def decode_layout(rows: int, max_pages: int, fields=FORWARD_FIELDS + TAIL_FIELDS) -> tuple[dict, int]:
    """({name: (byte offset, numpy dtype, shape)}, total bytes) of a padded decode step's packed buffer:
    each array at an offset aligned to PACK_ALIGN, in `fields` order."""
    layout, offset = {}, 0
    for name, dtype, kind in fields:
        shape = _shape(kind, rows, max_pages)
        layout[name] = (offset, np.dtype(dtype), shape)
        offset += round_up(int(np.prod(shape)) * np.dtype(dtype).itemsize, PACK_ALIGN)
    return layout, offset


def forward_bytes(rows: int, max_pages: int) -> int:
    """Bytes of the forward's part of the buffer (what ForwardBatch.from_step packs for a padded decode step)."""
    return decode_layout(rows, max_pages, FORWARD_FIELDS)[1]


def device_views(buffer: torch.Tensor, layout: dict, names) -> dict[str, torch.Tensor]:
    """Typed views of a packed uint8 buffer (device or host) at the layout's offsets."""
    out = {}
    for name in names:
        offset, dtype, shape = layout[name]
        n = int(np.prod(shape)) * dtype.itemsize
        out[name] = buffer[offset : offset + n].view(torch.from_numpy(np.zeros(0, dtype)).dtype).view(shape)
    return out


class _Slot:
    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.event = torch.cuda.Event() if device.type == "cuda" else None  # after the last copy that used this slot
        self.recorded = False
        self.rows_written = 0  # page-table rows that may hold entries of an earlier step
        self.width_written = 0  # and their columns

    def ready(self) -> None:
        """Wait until the slot's last copy is done (long since, with RING_DEPTH slots)."""
        if self.recorded:
            self.event.synchronize()

    def copied(self) -> torch.cuda.Event | None:
        """Mark the copy just queued: the slot is not reused before it is done."""
        if self.event is None:
            return None
        self.event.record(torch.cuda.current_stream(self.device))
        self.recorded = True
        return self.event


class DecodeInputs:
    """The ring of pinned input buffers of one graph bucket (`rows` rows, `max_pages` page-table columns)."""

    def __init__(self, rows: int, max_pages: int, page_size: int, device: torch.device, depth: int = RING_DEPTH):
        self.rows, self.max_pages, self.page_size, self.device = rows, max_pages, page_size, torch.device(device)
        self.layout, self.nbytes = decode_layout(rows, max_pages)
        self.slots = [_Slot(self.nbytes, self.device) for _ in range(depth)]
        self.views = [self._numpy_views(s.host) for s in self.slots]
        for v in self.views:  # the index arrays every padded decode step has (padding rows included)
            v["logits_rows"][:] = np.arange(rows)
            v["query_start"][:] = np.arange(rows + 1)
            v["query_lens"][:] = 1
            v["token_request"][:] = np.arange(rows)
        self._next = 0

    def _numpy_views(self, host: torch.Tensor) -> dict[str, np.ndarray]:
        raw = host.numpy()
        out = {}
        for name, (offset, dtype, shape) in self.layout.items():
            n = int(np.prod(shape)) * dtype.itemsize
            out[name] = raw[offset : offset + n].view(dtype).reshape(shape)
        return out

    def upload(
        self,
        step: StepBatch,
        into: torch.Tensor,
        feed_src: np.ndarray | None = None,
        inv_temperature=None,
        noise_rows=None,
    ) -> None:
        """Write the step's values into the next ring slot and queue its copy `into` the graph's static
        input buffer. Rows past the step's are padding (shared/step.py's sentinel page and padding
        state slot); `feed_src` None: no row is fed; `inv_temperature`/`noise_rows` None: every row
        greedy (the graph's sampled tokens are then not the step's)."""
        if into.numel() != self.nbytes:
            raise ValueError(f"the static input buffer has {into.numel()} bytes, the layout {self.nbytes}")
        slot, v = self.slots[self._next], self.views[self._next]
        self._next = (self._next + 1) % len(self.slots)
        slot.ready()
        r, ps = len(step.req_ids), self.page_size
        width = step.page_table.shape[1]
        if r > self.rows or width > self.max_pages:
            raise ValueError(
                f"a step of {r} requests and {width} pages does not fit a graph of {self.rows} rows "
                f"and {self.max_pages} pages"
            )
        clens = np.asarray(step.context_lens, dtype=np.int64)
        pages = step.page_table[np.arange(r), clens // ps].astype(np.int64)
        _put(v["tokens"], step.tokens, r)
        _put(v["positions"], clens, r)
        _put(v["slot_mapping"], pages * ps + clens % ps, r)
        _put(v["state_slots"], step.linear_state_slots, r)
        _put(v["context_lens"], clens, r)
        table = v["page_table"]
        table[: slot.rows_written, : slot.width_written] = 0
        table[:r, :width] = step.page_table
        slot.rows_written, slot.width_written = r, width
        v["real_tokens"][0] = r
        _put(v["feed_src"], feed_src if feed_src is not None else (), r, -1)
        _put(v["inv_temperature"], inv_temperature if inv_temperature is not None else (), r, 1.0)
        _put(v["noise_rows"], noise_rows if noise_rows is not None else (), r, -1)
        into.copy_(slot.host, non_blocking=True)
        slot.copied()


def _put(dst: np.ndarray, values, r: int, pad=0) -> None:
    """dst[:r] = values (or `pad` where there are none), dst[r:] = pad."""
    n = len(values)
    if n:
        dst[:n] = values
    dst[n:] = pad


class DecodeResults:
    """The ring of pinned result buffers of one graph bucket: [tokens int32 | logprobs float32] of its rows."""

    def __init__(self, rows: int, device: torch.device, depth: int = RING_DEPTH):
        self.rows, self.device = rows, torch.device(device)
        self.slots = [_Slot(8 * rows, self.device) for _ in range(depth)]
        self._next = 0

    def fetch(self, packed: torch.Tensor, n: int) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Queue the copy of the graph's packed results to the next ring slot: ([tokens [n], logprobs [n]]
        host views, the event after the copy), the shape of executor._to_host_async's answer."""
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        slot.ready()
        slot.host.copy_(packed, non_blocking=True)
        tokens = slot.host[: 4 * self.rows].view(torch.int32)[:n]
        logprobs = slot.host[4 * self.rows :].view(torch.float32)[:n]
        return [tokens, logprobs], slot.copied()
