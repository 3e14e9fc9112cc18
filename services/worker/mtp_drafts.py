"""MTP drafting on the worker (--speculative-method mtp): after a step's forward, the multi-token-prediction head
(models/mtp_head.py) keeps its own K/V of every real position of the step, and chains drafts for the rows that
ask (StepBatch.mtp_drafts); they go back in the step's answer (StepOutput.mtp_drafts) and the scheduler sends them,
as many as its draft-length controller chooses, as the request's next row's drafts.

Slots. The MTP layer's K/V live in its layer of the KV pool (plan/mtp_layer.py's `mtp_kv_layer`), paged with the
request's pages as the target's layers are. Slot t holds the entry of position t + 1: the head's input there is
the target's final-normed hidden state h_t and the embedding of token t + 1, turned at rotary position t + 1
(the head's convention). So an entry needs the token after its slot: a row of context c whose first n positions
are real (every position of a prompt's chunk; a verify row's up to its last kept draft) writes slots c .. c + n - 1,
its last entry taking the token after the row: the one it sampled, or for a prompt's chunk that does not sample the
next prompt token (StepBatch.next_tokens). Slot c - 1 was written by the row before. A refused draft's slots are
written again by the next row, as the target's K/V are.

What runs when. A slot's K/V depend on the layer's input alone (the fc over the two normed inputs, then the key
and value projections), so keeping them costs a few dense products a position, not the layer: every step writes
them (`MtpHead.write_kv`), a plain decode step inside its CUDA graph after the sampling (`write_decode_kv`), so a
request that does not draft pays almost nothing for the head. The whole layer (attention over the slots, the
experts) runs only in a chain: from an asking row's last slot L, the head's pass from that entry's inputs gives,
through the target's head, draft 1 (greedy argmax); its output hidden state stands for h_{L+1} and with draft 1's
embedding it goes through the head at slot L + 1 for draft 2, and so on: k drafts pass at slots L .. L + k - 1 (the
scheduler grows the request's pages for them; those past the row are overwritten once real tokens stand there).
Every step of the chain uses the head's first layer (the published checkpoints have one).

How many of a drafting row's drafts the verify kept is read back on the host before the head runs (the slots
depend on it), and a chain's drafts are read back at its end: a step that drafts or chains waits for the device
once more than a plain step."""

from __future__ import annotations

import numpy as np
import torch

from ferry.kernels.host_to_device import to_device
from ferry.plan.mtp_layer import mtp_kv_layer
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.models.mtp_head import MtpCache, MtpHead
from ferry.services.worker.pools import Pools
from ferry.shared.step import StepBatch


class MtpDrafter:
    def __init__(self, head: MtpHead, model, pools: Pools, page_size: int, device: torch.device):
        self.head = head
        self.model = model  # the target: its embedding table and its head
        self.pools = pools
        self.page_size = page_size
        self.device = device
        self.kv_layer = mtp_kv_layer(head.spec, 0)
        self.chain_position_s = 0.0  # the last chain's device seconds a position (CUDA; 0 off it)
        self.graphs = None  # the chain's graphs (mtp_chain_graphs.py), where the decode graphs captured them

    @torch.inference_mode()
    def run(
        self,
        batch: StepBatch,
        step_tokens: torch.Tensor,
        hidden: torch.Tensor,
        sampled: torch.Tensor,
        accepted: torch.Tensor | None,
        kv_written: bool = False,
    ) -> np.ndarray | None:
        """Write the head's K/V for the step's real positions and chain the asked drafts: int32 [S, K] for the
        step's S sampling rows (-1 past a row's drafts), or None where no row asks. `step_tokens` and `hidden`: the
        step's tokens and the target's final-normed hidden states of each (the step's order); `sampled`: each
        sampling row's token; `accepted`: the drafts each sampling row kept (None: no row drafted); `kv_written`:
        a decode graph wrote the K/V already, with these samples (`write_decode_kv`)."""
        r = len(batch.req_ids)
        asked = np.zeros(r, np.int64) if batch.mtp_drafts is None else batch.mtp_drafts.astype(np.int64)
        if kv_written and not asked.any():
            return None
        sample = batch.sample.astype(bool)
        sampling_row = np.cumsum(sample) - 1
        kept = np.zeros(int(sample.sum()), np.int64) if accepted is None else accepted.cpu().numpy().astype(np.int64)
        d = np.zeros(r, np.int64) if batch.draft_lens is None else batch.draft_lens.astype(np.int64)
        nxt = np.full(r, -1, np.int64) if batch.next_tokens is None else batch.next_tokens.astype(np.int64)
        q = batch.query_lens.astype(np.int64)
        qstart = np.concatenate([[0], np.cumsum(q)])
        t, s = int(qstart[-1]), len(sampled)
        # each entry's inputs: a row of `hidden`, and an index into (the step's tokens, its samples, next tokens)
        rows, hidden_rows, token_src, lens = [], [], [], []
        for i in range(r):
            a = int(qstart[i])
            if sample[i]:  # up to its last kept draft; the token after it: the one the row sampled
                n, after = int(q[i] - d[i] + kept[sampling_row[i]]), t + int(sampling_row[i])
            elif nxt[i] >= 0:  # a prompt's chunk: the prompt's next token
                n, after = int(q[i]), t + s + i
            else:  # the token after the chunk is not known (a prompt only scored): its last position has no entry
                n, after = int(q[i]) - 1, a + int(q[i]) - 1
            if n <= 0:
                continue
            rows.append(i)
            lens.append(n)
            hidden_rows.extend(range(a, a + n))
            token_src.extend([*range(a + 1, a + n), after])
        if not rows:
            return None
        next_prompt = to_device(nxt.clip(min=0).tolist(), torch.int64, self.device)
        source = torch.cat([step_tokens[:t], sampled.to(step_tokens.dtype), next_prompt])
        tokens = source[to_device(token_src, torch.int64, self.device)]
        entries = hidden[to_device(hidden_rows, torch.int64, self.device)]
        if not kv_written:
            step = _slots_batch(batch, rows, lens, [int(batch.context_lens[i]) for i in rows])
            mb = ForwardBatch.from_step(step, self.page_size, self.device)
            self.head.write_kv(entries, self.model.embed(tokens), mb.positions + 1, self._cache(mb))
        if not asked.any():
            return None
        return self._chain(batch, rows, lens, entries, tokens, asked, sampling_row, s)

    def _chain(self, batch, rows, lens, entries, tokens, asked, sampling_row, s) -> np.ndarray:
        """Chain each asking row's drafts (the module docstring): the head's whole layer at its last slot L from
        that entry's inputs, then at L + 1, L + 2, ... from its own output and the draft before."""
        ends = np.cumsum(lens) - 1
        chain = [(j, i) for j, i in enumerate(rows) if asked[i] > 0]
        k_max = int(max(asked[i] for _, i in chain))
        drafts = torch.full((s, k_max), -1, dtype=torch.int64, device=self.device)
        # each chaining row: its row in the step, its last slot, its sampling row, the drafts it asks
        row = np.array([i for _, i in chain], np.int64)
        last = np.array([int(batch.context_lens[i]) + lens[j] - 1 for j, i in chain], np.int64)
        at = np.array([sampling_row[i] for _, i in chain], np.int64)
        k = asked[row]
        first = to_device(ends[[j for j, _ in chain]].tolist(), torch.int64, self.device)
        g, token = entries[first], tokens[first]
        shape = self.graphs.shape_for(len(chain), k_max) if self.graphs is not None else None
        if shape is not None:  # the chain's positions in one replay (mtp_chain_graphs.py)
            chained = self.graphs.run(shape, g, token, last, k, np.asarray(batch.page_table)[row])
            drafts[to_device(at.tolist(), torch.int64, self.device)] = chained
            out = drafts.to(torch.int32).cpu().numpy()  # waits for the chain
            if self.graphs.last_replay is not None:
                start, end = self.graphs.last_replay
                self.chain_position_s = start.elapsed_time(end) / 1e3 / k_max
            return out
        timed = torch.cuda.Event(enable_timing=True) if self.device.type == "cuda" else None
        if timed is not None:
            timed.record()
        for n in range(k_max):
            live = np.flatnonzero(k > n)
            if live.size < len(k):  # rows whose chain is done drop out
                pick = to_device(live.tolist(), torch.int64, self.device)
                g, token, row, last, at, k = g[pick], token[pick], row[live], last[live], at[live], k[live]
            step = _slots_batch(batch, row.tolist(), [1] * len(row), (last + n).tolist())
            mb = ForwardBatch.from_step(step, self.page_size, self.device)
            g = self.head(g, self.model.embed(token), mb.positions + 1, cache=self._cache(mb))
            token = self.model.draft_tokens(g, self.head.draft_vocab)
            drafts[to_device(at.tolist(), torch.int64, self.device), n] = token
        end = None
        if timed is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        out = drafts.to(torch.int32).cpu().numpy()  # waits for the chain
        if end is not None:
            self.chain_position_s = timed.elapsed_time(end) / 1e3 / k_max
        return out

    def _cache(self, mb: ForwardBatch) -> MtpCache:
        return MtpCache(self.pools.kv, self.kv_layer, mb)


def write_decode_kv(head: MtpHead, model, pools: Pools, batch: ForwardBatch, hidden, sampled) -> None:
    """The head's K/V of a decode step's rows (one position each, the token after it the row's sample), as a
    decode graph writes them after its sampling (decode_graphs.py): `batch` the step's, its slots the MTP layer's
    too (the same pages), `hidden` its final-normed hidden states."""
    cache = MtpCache(pools.kv, mtp_kv_layer(head.spec, 0), batch)
    head.write_kv(hidden, model.embed(sampled), batch.positions + 1, cache)


def _slots_batch(batch: StepBatch, rows: list[int], lens: list[int], starts: list[int]) -> StepBatch:
    """A batch of the MTP layer's slots: for each of `rows` (rows of `batch`, whose page tables it reads) `lens`
    slots from `starts`; its tokens are placeholders (the head is given its inputs) and nothing samples."""
    n = len(rows)
    return StepBatch(
        step_id=batch.step_id,
        req_ids=np.asarray(batch.req_ids)[rows],
        tokens=np.zeros(int(sum(lens)), np.int32),
        query_lens=np.array(lens, np.int32),
        context_lens=np.array(starts, np.int32),
        page_table=np.asarray(batch.page_table)[rows],
        linear_state_slots=np.asarray(batch.linear_state_slots)[rows],
        reset_linear_state=np.zeros(n, bool),
        sample=np.zeros(n, bool),
    )
