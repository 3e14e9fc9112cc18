"""KV page ids: usable pages are 1..pages; page 0 is the worker's sentinel and is never handed out."""

from __future__ import annotations


class PageAllocator:
    def __init__(self, pages: int):
        if pages < 1:
            raise ValueError(f"a KV pool needs at least one usable page, the worker reported {pages}")
        self.total = pages
        self._free = list(range(pages, 0, -1))  # pop() hands out low ids first: easier to read in logs

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(pages)
