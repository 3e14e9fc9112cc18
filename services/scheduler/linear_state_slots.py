"""The scheduler's linear-state slots (hybrid models): usable ids 1..slots; slot 0 is the worker's padding slot."""

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
