"""The MTP head's draft chain replayed as CUDA graphs (--speculative-method mtp): one graph per (rows, positions),
captured at boot beside the decode graphs, into their pool.

A chain (mtp_drafts.py) passes the head's whole layer, then the target's LM head (its first --speculative-draft-vocab
rows where given) and an argmax, once a position, each
pass fed by the one before: eagerly, each position cost its launches and a batch built on the host, several times the
device's work. Here a graph holds all k positions of up to `rows` chaining rows: its inputs are each row's start (the
head's input hidden state and token at its last slot L), L, the drafts it asks and its page table, and everything a
position needs is derived on the device: position L + j, the slot that position's K/V go to (through the page
table), the draft. A row that asks fewer than k drafts is done after its own: its later positions stay at its last
one, their K/V written to the sentinel page and their drafts -1, so nothing past the pages the scheduler grew for
the row is touched; padding rows (no drafts asked) likewise sit at position 0 of the sentinel page.

Shapes: rows in the decode graphs' buckets up to CHAIN_MAX_ROWS, positions 1 to --speculative-tokens."""

from __future__ import annotations

import numpy as np
import torch

from ferry.kernels.host_to_device import to_device
from ferry.plan.mtp_layer import mtp_kv_layer
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.models.mtp_head import MtpCache

# the most rows a chain graph has (a step's chaining rows: those the controller lets draft); more chain eagerly
CHAIN_MAX_ROWS = 8


def chain_shapes(decode_buckets: list[int], speculative_tokens: int) -> list[tuple[int, int]]:
    """(rows, positions) of the chain graphs, for the decode graphs' row buckets and --speculative-tokens K."""
    return [(rows, k) for rows in decode_buckets if rows <= CHAIN_MAX_ROWS for k in range(1, speculative_tokens + 1)]


class _Chain:
    def __init__(self, rows: int, positions: int, max_pages: int, hidden: int, dtype, device: torch.device):
        self.rows, self.positions = rows, positions
        self.start_hidden = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.start_token = torch.zeros(rows, dtype=torch.int64, device=device)
        # int64 [2, rows]: each row's last slot L and the drafts it asks (padding rows: 0 and 0), in one upload
        self.rows_in = torch.zeros(2, rows, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)
        self.drafts = torch.full((rows, positions), -1, dtype=torch.int64, device=device)
        self.graph = torch.cuda.CUDAGraph() if device.type == "cuda" else None  # CPU: the tests of its body


class ChainGraphs:
    def __init__(self, head, model, pools, page_size: int, max_pages: int, shapes, device: torch.device):
        self.head, self.model, self.pools = head, model, pools
        self.page_size, self.max_pages = page_size, max_pages
        self.device = torch.device(device)
        self.shapes = sorted(shapes)
        self.kv_layer = mtp_kv_layer(head.spec, 0)
        self.chains: dict[tuple[int, int], _Chain] = {}
        self.last_replay: tuple | None = None  # the last replay's (start, end) timing events (CUDA)

    def capture(self, pool, warmups: int = 2) -> None:
        """Warm each shape up eagerly, then capture it into the decode graphs' `pool`, the most positions and rows
        first. Padding rows only: nothing a request holds is written. Off CUDA nothing is captured."""
        hidden, dtype = self.head.spec.hidden_size, self.model.dtype
        if self.device.type != "cuda":
            for shape in self.shapes:
                self.chains[shape] = _Chain(*shape, self.max_pages, hidden, dtype, self.device)
            return
        for rows, k in sorted(self.shapes, key=lambda s: (s[1], s[0]), reverse=True):
            c = _Chain(rows, k, self.max_pages, hidden, dtype, self.device)
            for _ in range(warmups):
                self._chain(c, None)
            torch.cuda.synchronize(self.device)
            with torch.cuda.graph(c.graph, pool=pool):
                self._chain(c, None)
            self.chains[(rows, k)] = c
        torch.cuda.synchronize(self.device)

    def shape_for(self, rows: int, positions: int) -> tuple[int, int] | None:
        return next(((r, k) for r, k in self.shapes if k == positions and r >= rows and (r, k) in self.chains), None)

    def run(
        self,
        shape: tuple[int, int],
        start_hidden: torch.Tensor,
        start_token: torch.Tensor,
        last: np.ndarray,
        asked: np.ndarray,
        page_table: np.ndarray,
    ) -> torch.Tensor:
        """The drafts [n, positions] (-1 past a row's asks) of n chaining rows: each from `start_hidden` and
        `start_token` (the head's inputs at its last slot `last`), asking `asked` drafts, its pages `page_table`."""
        c = self.chains[shape]
        n = len(last)
        c.start_hidden[:n].copy_(start_hidden)
        c.start_token[:n].copy_(start_token)
        host = np.zeros((2, c.rows), np.int64)
        host[0, :n], host[1, :n] = last, asked
        c.rows_in.copy_(to_device(host, torch.int64, self.device))
        table = np.zeros((c.rows, self.max_pages), np.int32)
        table[:n, : page_table.shape[1]] = page_table
        c.page_table.copy_(to_device(table, torch.int32, self.device))
        if c.graph is None:
            self._chain(c, host)
            self.last_replay = None
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            c.graph.replay()
            end.record()
            self.last_replay = (start, end)
        return c.drafts[:n]

    def _chain(self, c: _Chain, host: np.ndarray | None) -> None:
        """What a graph holds: the chain's positions, each one pass of the head, the LM head and the argmax.
        `host`: the rows' last slots and asks as the host knows them (off CUDA the reference attention reads the
        lengths on the host); None while capturing (the Triton kernels read the device's)."""
        last, asked = c.rows_in[0], c.rows_in[1]
        rows, ps = c.rows, self.page_size
        at_last = (last + asked - 1).clamp(min=0)  # where a row that is done (or padding) stays
        hidden, token = c.start_hidden, c.start_token
        for j in range(c.positions):
            live = asked > j
            position = torch.where(live, last + j, at_last)
            page = c.page_table.gather(1, (position // ps).unsqueeze(1)).squeeze(1).to(torch.int64)
            slot = torch.where(live, page * ps + position % ps, torch.zeros_like(position))
            if host is None:
                lens = [0] * rows
            else:
                lens = np.where(host[1] > j, host[0] + j, np.maximum(host[0] + host[1] - 1, 0)).tolist()
            batch = self._position_batch(c, position, slot, lens)
            cache = MtpCache(self.pools.kv, self.kv_layer, batch)
            hidden = self.head(hidden, self.model.embed(token), position + 1, cache=cache)
            token = self.model.draft_tokens(hidden, self.head.draft_vocab)
            c.drafts[:, j].copy_(torch.where(live, token, torch.full_like(token, -1)))

    def _position_batch(self, c: _Chain, position, slot, context_lens: list[int]) -> ForwardBatch:
        """One chain position of every row as the head's attention reads it: one token a row at `position`."""
        rows, device = c.rows, self.device
        steps = torch.arange(rows + 1, dtype=torch.int32, device=device)
        zeros = torch.zeros(rows, dtype=torch.int64, device=device)
        return ForwardBatch(
            tokens=zeros,
            positions=position,
            query_start=steps,
            query_lens=torch.ones(rows, dtype=torch.int32, device=device),
            context_lens=position.to(torch.int32),
            page_table=c.page_table,
            slot_mapping=slot,
            state_slots=zeros,
            reset_state=torch.zeros(rows, dtype=torch.bool, device=device),
            logits_rows=torch.arange(rows, dtype=torch.int64, device=device),
            token_request=steps[:rows],
            real_tokens=torch.full((1,), rows, dtype=torch.int32, device=device),
            sample_mask=np.zeros(rows, bool),
            query_lens_host=[1] * rows,
            context_lens_host=context_lens,
            state_slots_host=[0] * rows,
            page_size=self.page_size,
            device=device,
        )
