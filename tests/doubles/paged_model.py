"""Test double of the worker's StepExecutor: a 'model' whose next token is a hash of the whole context,
read back from the KV pages it wrote. A wrong page table, a reused page whose contents differ, a
page freed while in use, or a write to the sentinel page changes the output or raises, so tests
that compare against `reference_continuation` check the scheduler's page bookkeeping for real.

Hybrid mode also keeps a per-slot running hash (the 'linear state') and checks it against the pages, and
linear-state snapshots (the prefix cache's): a restored slot takes a snapshot's hash before the step, a saved
snapshot the slot's hash after it, so a snapshot restored at the wrong position, or overwritten while it is
still wanted, gives a state that disagrees with the pages (an assertion) and a wrong continuation.
"""

from __future__ import annotations

import numpy as np

from ferry.shared.step import StepBatch, StepOutput

_MOD = (1 << 61) - 1
_BASE = 1_000_003


def _extend(h: int, token: int) -> int:
    return (h * _BASE + token + 1) % _MOD


def next_token(h: int, vocab) -> int:
    return vocab[(h >> 7) % len(vocab)]


def reference_continuation(prompt: list[int], n: int, vocab, stop_ids=()) -> list[int]:
    h, out = 0, []
    for t in prompt:
        h = _extend(h, t)
    for _ in range(n):
        t = next_token(h, vocab)
        out.append(t)
        if t in stop_ids:
            break
        h = _extend(h, t)
    return out


class PagedHashModel:
    def __init__(self, pages: int, page_size: int, vocab, linear_state_slots: int = 0, snapshots: int = 0):
        self.page_size = page_size
        self.vocab = list(vocab)  # the token ids it may produce
        self.kv = np.full((pages + 1, page_size), -1, dtype=np.int64)
        self.state = np.zeros(linear_state_slots + 1, dtype=np.int64)
        # each snapshot: (hash, position) of the state it holds; position -1: never written
        self.snapshots = np.full((snapshots, 2), -1, dtype=np.int64)
        self.restored_tokens = 0  # tokens whose state came from a snapshot rather than being computed
        self.saved_inside = 0  # snapshots taken inside a row's chunk (StepBatch.save_offset)
        self.hybrid = linear_state_slots > 0
        self.known: set[int] = set()  # requests the sampler holds state for
        self.steps = 0
        self.batches: list[StepBatch] = []

    @staticmethod
    def _inside(batch: StepBatch, i: int, q: int) -> int | None:
        """How many of row i's q tokens come before its save inside the chunk (None: no such save)."""
        if batch.save_state is None or batch.save_offset is None or batch.save_state[i] < 0:
            return None
        offset = int(batch.save_offset[i])
        return offset if offset < q else None

    def execute(self, batch: StepBatch) -> StepOutput:
        self.steps += 1
        self.batches.append(batch)
        for rid in batch.finished_req_ids:
            self.known.discard(rid)
        for nr in batch.new_requests:
            assert nr.req_id not in self.known, f"request {nr.req_id} announced twice"
            self.known.add(nr.req_id)
        out_ids, out_tokens = [], []
        start = 0
        ps = self.page_size
        if batch.restore_state is not None:  # before the forward
            for i in np.flatnonzero(batch.restore_state >= 0).tolist():
                h, pos = self.snapshots[int(batch.restore_state[i])].tolist()
                assert pos == int(batch.context_lens[i]), (
                    f"snapshot of position {pos} restored at {batch.context_lens[i]}"
                )
                assert not batch.reset_linear_state[i]
                self.state[int(batch.linear_state_slots[i])] = h
                self.restored_tokens += pos
        for i, rid in enumerate(batch.req_ids.tolist()):
            assert rid in self.known, f"request {rid} stepped without a NewRequest"
            q, ctx = int(batch.query_lens[i]), int(batch.context_lens[i])
            chunk = batch.tokens[start : start + q].tolist()
            start += q
            for j, tok in enumerate(chunk):
                pos = ctx + j
                page = int(batch.page_table[i, pos // ps])
                assert page != 0, f"request {rid} writes position {pos} into the sentinel page"
                self.kv[page, pos % ps] = tok
            if self.hybrid:
                slot = int(batch.linear_state_slots[i])
                assert slot != 0, f"hybrid request {rid} has no linear-state slot"
                if batch.reset_linear_state[i]:
                    assert ctx == 0, "state reset in the middle of a sequence"
                    self.state[slot] = 0
                h = int(self.state[slot])
                inside = self._inside(batch, i, q)
                for j, tok in enumerate(chunk):
                    if j == inside:  # a save inside the chunk keeps the state after its first `inside` tokens
                        self.snapshots[int(batch.save_state[i])] = (h, ctx + j)
                    h = _extend(h, tok)
                self.state[slot] = h
            if batch.sample[i]:
                h = 0
                for pos in range(ctx + q):
                    tok = int(self.kv[int(batch.page_table[i, pos // ps]), pos % ps])
                    assert tok >= 0, f"request {rid} reads an unwritten KV slot at position {pos}"
                    h = _extend(h, tok)
                if self.hybrid:
                    assert h == int(self.state[int(batch.linear_state_slots[i])]), "linear state diverged from KV"
                out_ids.append(rid)
                out_tokens.append(next_token(h, self.vocab))
        assert start == len(batch.tokens), "query_lens do not cover the batch's tokens"
        if batch.save_state is not None:  # after the forward
            ends = batch.context_lens + batch.query_lens
            for i in np.flatnonzero(batch.save_state >= 0).tolist():
                at = int(batch.context_lens[i]) + (
                    int(batch.save_offset[i]) if batch.save_offset is not None else int(batch.query_lens[i])
                )
                assert at % ps == 0, "a snapshot off a page boundary"
                if at == int(ends[i]):
                    self.snapshots[int(batch.save_state[i])] = (int(self.state[int(batch.linear_state_slots[i])]), at)
                self.saved_inside += at != int(ends[i])
        return StepOutput(
            step_id=batch.step_id,
            req_ids=np.array(out_ids, dtype=np.int64),
            token_ids=np.array(out_tokens, dtype=np.int32),
            logprobs=np.zeros(len(out_ids), dtype=np.float32),
        )
