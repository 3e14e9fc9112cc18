"""The scheduler's KV page pool: which pages are free, which each request holds, and the prefix cache
that may lend pages back. Page ids only: the K/V tensors are the worker's (its KvTensorPool)."""

from __future__ import annotations

from ferry.services.scheduler.page_allocator import PageAllocator
from ferry.services.scheduler.radix_cache import RadixCache
from ferry.services.scheduler.request import Request
from ferry.shared.units import ceil_div


class KvPagePool:
    def __init__(self, pages: int, page_size: int, prefix_reuse: bool):
        self.page_size = page_size
        self.allocator = PageAllocator(pages)
        self.cache = RadixCache(page_size, self.allocator)
        self.prefix_reuse = prefix_reuse

    @property
    def total(self) -> int:
        return self.allocator.total

    @property
    def available(self) -> int:
        """Pages a new request could get now: free ones plus cached ones nobody holds."""
        return self.allocator.free_count + self.cache.unreferenced

    def allocate(self, n: int) -> list[int] | None:
        short = n - self.allocator.free_count
        if short > 0:
            self.cache.evict(short)
        return self.allocator.allocate(n)

    def grow(self, req: Request, tokens: int) -> bool:
        """Give `req` enough pages to hold `tokens` tokens; False (and nothing taken) if the pool is short."""
        need = ceil_div(tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        new = self.allocate(need)
        if new is None:
            return False
        req.pages.extend(new)
        return True

    def trim(self, req: Request, tokens: int) -> None:
        """Release req's pages past those holding `tokens` tokens: a verify row's rejected drafts grew them
        (shared/speculation.py). Pages of the prefix cache are never past its computed tokens."""
        keep = max(ceil_div(tokens, self.page_size), len(req.nodes))
        if keep < len(req.pages):
            self.allocator.release(req.pages[keep:])
            del req.pages[keep:]

    def reuse_prefix(self, req: Request, limit: int | None = None) -> None:
        """Attach the longest cached prefix of req.tokens (leaving at least one token to compute, whose
        logits give the next token), of at most `limit` tokens."""
        if not self.prefix_reuse:
            return
        self.hold(req, self.match(req, limit))

    def match(self, req: Request, limit: int | None = None) -> list:
        """The longest cached chain of full pages prefixing req.tokens that leaves at least one token to
        compute, of at most `limit` tokens; nothing is held."""
        pages = (len(req.tokens) - 1) // self.page_size
        if limit is not None:
            pages = min(pages, limit // self.page_size)
        return self.cache.match(req.tokens, pages)

    def hold(self, req: Request, chain: list) -> None:
        """req starts from `chain` (a prefix of a `match`): its pages are shared, its computation starts after it."""
        self.cache.acquire(chain)
        req.nodes = list(chain)
        req.pages = [n.page for n in chain]
        req.num_computed = len(chain) * self.page_size

    def cache_full_pages(self, req: Request) -> None:
        """Publish req's newly completed pages to the prefix cache. A page whose prefix is already cached
        is swapped for the cached one (same tokens, same K/V) and freed."""
        if not self.prefix_reuse:
            return
        ps = self.page_size
        while (len(req.nodes) + 1) * ps <= req.num_computed:
            i = len(req.nodes)
            parent = req.nodes[-1] if req.nodes else None
            node = self.cache.insert(parent, tuple(req.tokens[i * ps : (i + 1) * ps]), req.pages[i])
            if node.page != req.pages[i]:
                self.allocator.release([req.pages[i]])
                req.pages[i] = node.page
            req.nodes.append(node)

    def release(self, req: Request) -> None:
        """Return everything req holds: cached pages go back to the cache (unreferenced), the rest to the free list."""
        self.cache_full_pages(req)
        self.cache.release(req.nodes)
        self.allocator.release(req.pages[len(req.nodes) :])
        req.nodes, req.pages, req.num_computed = [], [], 0
