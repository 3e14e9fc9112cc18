"""The scheduler's request slots: usable ids 1..slots, slot 0 the worker's padding slot. A running request holds one
where the worker keeps per-request state by slot: a hybrid model's linear state, and the rings of sliding KV groups
(plan/kv_groups.py)."""

from __future__ import annotations


class LinearStateSlotAllocator:
    def __init__(self, slots: int):
        self.total = slots
        self._released: list[int] = []  # handed out again first; then the never-used ones, lowest first
        self._next_fresh = 1  # a counter, not a list: memory follows the slots in use, not the reported size

    @property
    def free_count(self) -> int:
        return len(self._released) + self.total + 1 - self._next_fresh

    def allocate(self) -> int | None:
        if self._released:
            return self._released.pop()
        if self._next_fresh > self.total:
            return None
        self._next_fresh += 1
        return self._next_fresh - 1

    def release(self, slot: int) -> None:
        if slot:
            self._released.append(slot)
