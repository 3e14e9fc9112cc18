"""Linear-state snapshot ids (hybrid models' prefix cache): which snapshot holds the Gated DeltaNet state at
the end of which cached prefix. Ids only, 0..total-1: the tensors are the worker's (LinearStatePool's
snapshot pool), written and read by the step's state copies (shared/step.py: save_state, restore_state).

A snapshot is *pending* from the step that saves it until that step's answer, then *attached* to the radix
node whose page ends at its position (a node's snapshot is the state after the node's whole prefix). Only
attached snapshots are reused or evicted. A snapshot goes:
* with its node, when the KV cache evicts that node (RadixCache.on_evict): the state is useless without
  the K/V of the same prefix;
* least-recently-used first (attached or reused), when a save needs an id and none is free;
* when its request abandons it (the step failed, or the row was dropped).

No pin is needed for a snapshot a step restores: the worker runs a step's restores before its forward
and its saves after it, and steps in order, so an id evicted and saved into again, in the same step or a
later one, is only overwritten after every restore sent before it has read it.
"""

from __future__ import annotations

import heapq
import itertools


class Snapshot:
    __slots__ = ("id", "node", "last_used", "pending")

    def __init__(self, sid: int):
        self.id = sid
        self.node = None  # the radix Node it is attached to; None while pending, and once dropped
        self.last_used = 0
        self.pending = True  # taken for a save whose step has not landed yet


class StateSnapshots:
    def __init__(self, total: int):
        self.total = total
        self.held = 0  # attached snapshots
        self.evictions = 0  # attached snapshots dropped: with their node, or for room
        self._released: list[int] = []  # handed out again first; then the never-used ids, lowest first
        self._next_fresh = 0  # a counter: memory follows the snapshots in use, not the reported size
        self._lru: list[tuple[int, int, Snapshot]] = []  # (last_used, seq, snapshot); stale entries skipped
        self._tick = itertools.count(1)
        self._seq = itertools.count()

    @property
    def free_count(self) -> int:
        return len(self._released) + self.total - self._next_fresh

    def take(self) -> Snapshot | None:
        """A pending snapshot: a free id, else the least recently used attached one's (dropped); None when
        every id is pending."""
        if self._released:
            return Snapshot(self._released.pop())
        if self._next_fresh < self.total:
            self._next_fresh += 1
            return Snapshot(self._next_fresh - 1)
        while self._lru:
            last_used, _, snap = heapq.heappop(self._lru)
            if snap.node is None or snap.last_used != last_used:
                continue  # stale: dropped, or used again since
            self._detach(snap)
            self.evictions += 1
            return Snapshot(snap.id)
        return None

    def recycle(self, snap: Snapshot) -> Snapshot:
        """The id of an attached snapshot, detached, for a new save that replaces it (a request's rolling
        snapshot in its output: only the last one is worth keeping)."""
        self._detach(snap)
        return Snapshot(snap.id)

    def attach(self, snap: Snapshot, node) -> bool:
        """A pending snapshot's save landed: attach it to `node`. A node that already has one keeps it
        (the same prefix, the same state) and the new id is freed; False then."""
        if node.snapshot is not None:
            self.free(snap)
            return False
        snap.pending = False
        node.snapshot, snap.node = snap, node
        self.held += 1
        self.touch(snap)
        return True

    def touch(self, snap: Snapshot) -> None:
        snap.last_used = next(self._tick)
        heapq.heappush(self._lru, (snap.last_used, next(self._seq), snap))
        if len(self._lru) > 4 * self.held + 64:  # stale entries: rebuild from the attached snapshots
            live = {id(s): s for _, _, s in self._lru if s.node is not None}.values()
            self._lru = [(s.last_used, next(self._seq), s) for s in live]
            heapq.heapify(self._lru)

    def drop(self, node) -> None:
        """`node` leaves the KV cache: its snapshot goes with it."""
        snap = node.snapshot
        if snap is not None:
            self._detach(snap)
            self._released.append(snap.id)
            self.evictions += 1

    def free(self, snap: Snapshot) -> None:
        """A pending snapshot that will never attach."""
        snap.pending = False
        self._released.append(snap.id)

    def _detach(self, snap: Snapshot) -> None:
        snap.node.snapshot = None
        snap.node = None
        self.held -= 1
