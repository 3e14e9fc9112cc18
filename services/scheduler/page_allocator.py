"""KV page ids: usable pages are 1..pages; page 0 is the worker's sentinel and is never handed out."""

from __future__ import annotations


class PageAllocator:
    def __init__(self, pages: int):
        if pages < 1:
            raise ValueError(f"a KV pool needs at least one usable page, the worker reported {pages}")
        self.total = pages
        # Released pages are handed out again first (last released, first out); then the never-used ones,
        # lowest id first (easier to read in logs). Never-used pages are a counter, not a list, so the
        # allocator's memory follows the pages in use, whatever size the worker reports.
        self._released: list[int] = []
        self._next_fresh = 1

    @property
    def free_count(self) -> int:
        return len(self._released) + self.total + 1 - self._next_fresh

    def allocate(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer than n are free."""
        if n > self.free_count:
            return None
        take = min(n, len(self._released))
        out = [self._released.pop() for _ in range(take)]
        fresh = n - take
        out.extend(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        return out

    def release(self, pages: list[int]) -> None:
        self._released.extend(pages)
