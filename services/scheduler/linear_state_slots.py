"""The scheduler's linear-state slots (hybrid models): usable ids 1..slots; slot 0 is the worker's padding slot."""

from __future__ import annotations


class LinearStateSlotAllocator:
    def __init__(self, slots: int):
        self.total = slots
        self._free = list(range(slots, 0, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        if slot:
            self._free.append(slot)
