"""A radix tree over full KV pages: requests sharing a prompt prefix share its pages.

Each node is one full page; its key is that page's token ids and its path from the root is the
whole prefix, so a node's KV is valid for exactly that prefix. Nodes held by a running request
have refs > 0. Nodes no request holds stay cached until the allocator needs their pages, then
they are evicted least-recently-used first, leaves before their parents (a child's KV depends on
its parent's prefix, and a touched path is touched from the root down, so LRU order and
leaf-first order agree).

Hybrid models also attach a linear-state snapshot to some nodes (`Node.snapshot`, state_snapshots.py):
the state after the node's whole prefix. An evicted node takes its snapshot with it (`on_evict`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from ferry.services.scheduler.page_allocator import PageAllocator


class Node:
    __slots__ = ("page", "key", "parent", "children", "refs", "last_used", "snapshot")

    def __init__(self, page: int, key: tuple[int, ...], parent: Node | None):
        self.page = page
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.refs = 0
        self.last_used = 0
        self.snapshot = None  # hybrid models: the linear-state Snapshot at this node's end, if one is kept


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator):
        self.page_size = page_size
        self.allocator = allocator
        self.root = Node(page=-1, key=(), parent=None)
        self.nodes = 0
        self.unreferenced = 0  # cached pages no request holds: evictable
        self._tick = itertools.count(1)
        self._evictable: list[tuple[int, int, Node]] = []  # (last_used, seq, node); stale entries skipped
        self._seq = itertools.count()
        self.on_evict: Callable[[Node], None] | None = None  # told of each node evicted (its snapshot goes too)

    def match(self, tokens: Sequence[int], max_pages: int) -> list[Node]:
        """The longest cached chain of full pages that prefixes `tokens`, at most max_pages long."""
        ps, node, chain = self.page_size, self.root, []
        for i in range(max_pages):
            child = node.children.get(tuple(tokens[i * ps : (i + 1) * ps]))
            if child is None:
                break
            chain.append(child)
            node = child
        return chain

    def acquire(self, chain: Sequence[Node]) -> None:
        now = next(self._tick)
        for node in chain:
            if node.refs == 0:
                self.unreferenced -= 1
            node.refs += 1
            node.last_used = now

    def release(self, chain: Sequence[Node]) -> None:
        now = next(self._tick)
        for node in reversed(chain):  # leaves first, so they enter the eviction heap
            node.refs -= 1
            node.last_used = now
            if node.refs == 0:
                self.unreferenced += 1
                self._push_if_evictable(node)

    def insert(self, parent: Node | None, key: tuple[int, ...], page: int) -> Node:
        """Cache `page` as the child `key` of `parent` (None: the root) and hold it. When that prefix is
        already cached, hold the cached node instead; the caller then frees its own copy of the page."""
        parent = parent or self.root
        node = parent.children.get(key)
        if node is None:
            node = Node(page, key, parent)
            parent.children[key] = node
            self.nodes += 1
            self.unreferenced += 1  # acquire() below takes it back
        self.acquire([node])
        return node

    def evict(self, pages: int) -> int:
        """Free up to `pages` unreferenced pages into the allocator, LRU leaves first; returns how many."""
        freed = 0
        while freed < pages and self._evictable:
            last_used, _, node = heapq.heappop(self._evictable)
            if node.refs or node.children or node.parent is None or node.last_used != last_used:
                continue  # stale entry: held again, grew children, or already evicted
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.nodes -= 1
            self.unreferenced -= 1
            self.allocator.release([node.page])
            if node.snapshot is not None and self.on_evict is not None:
                self.on_evict(node)
            freed += 1
            if parent is not self.root:
                self._push_if_evictable(parent)
        return freed

    def _push_if_evictable(self, node: Node) -> None:
        if node.refs == 0 and not node.children:
            heapq.heappush(self._evictable, (node.last_used, next(self._seq), node))
