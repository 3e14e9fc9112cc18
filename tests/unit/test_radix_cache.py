"""The prefix cache: LRU eviction of unreferenced leaves, and page accounting under random workloads."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.services.scheduler.batcher import BatchScheduler
from ferry.services.scheduler.page_allocator import PageAllocator
from ferry.services.scheduler.radix_cache import RadixCache
from ferry.shared.messages import PoolReport
from ferry.shared.sampling import SamplingParams
from tests.doubles.paged_model import PagedHashModel, reference_continuation
from tests.unit.test_batch_scheduler import run_aborting_to_end


def chain(cache: RadixCache, alloc: PageAllocator, keys: list[tuple[int, ...]]):
    nodes, parent = [], None
    for key in keys:
        page = alloc.allocate(1)[0]
        node = cache.insert(parent, key, page)
        if node.page != page:
            alloc.release([page])
        nodes.append(node)
        parent = node
    return nodes


def test_least_recently_used_leaves_go_first_and_parents_only_after_their_children():
    alloc = PageAllocator(10)
    cache = RadixCache(2, alloc)
    a = chain(cache, alloc, [(1, 1), (2, 2), (3, 3)])
    b = chain(cache, alloc, [(1, 1), (2, 2), (4, 4)])  # shares two pages with a
    assert cache.nodes == 4 and alloc.free_count == 6
    cache.release(b)
    cache.release(a)  # a's leaf is now more recent than b's
    assert cache.unreferenced == 4
    assert cache.evict(1) == 1
    assert cache.match([1, 1, 2, 2, 4, 4], 3) == a[:2]  # b's leaf (4, 4) went first
    assert len(cache.match([1, 1, 2, 2, 3, 3], 3)) == 3
    assert cache.evict(10) == 3 and cache.nodes == 0 and alloc.free_count == 10


def test_held_pages_are_never_evicted():
    alloc = PageAllocator(4)
    cache = RadixCache(2, alloc)
    held = chain(cache, alloc, [(1, 1), (2, 2)])
    assert cache.evict(4) == 0 and cache.nodes == 2
    cache.release(held[1:])
    assert cache.evict(4) == 1 and cache.match([1, 1, 2, 2], 2) == held[:1]


workload = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 14), st.integers(1, 12), st.booleans()), min_size=1, max_size=10
)  # (shared prefix id, own prompt length, max_tokens, abort midway)


@settings(max_examples=80, deadline=None)
@given(workload, st.integers(8, 40), st.sampled_from([2, 4]), st.integers(4, 64))
def test_random_workloads_generate_the_reference_and_return_every_page(jobs, pages, page_size, prefill):
    vocab = range(10, 60)
    pool = PoolReport(
        kv_pages=pages,
        page_size=page_size,
        linear_state_slots=0,
        max_running_requests=4,
        max_prefill_tokens=prefill,
        max_model_len=64,
    )
    sched, model = BatchScheduler(pool), PagedHashModel(pages, page_size, vocab)
    prefixes = [np.random.default_rng(p).integers(10, 60, 9).tolist() for p in range(4)]
    expected, aborted = {}, set()
    for rid, (prefix, own, max_tokens, abort) in enumerate(jobs, start=1):
        p = prefixes[prefix] + np.random.default_rng(100 + rid).integers(10, 60, own).tolist()
        try:
            sched.add(rid, b"c", rid, np.array(p, np.int32), SamplingParams(temperature=0), max_tokens)
        except Exception:  # noqa: BLE001 - too big for this pool: refused at admission, fine
            continue
        expected[rid] = reference_continuation(p, max_tokens, vocab)
        if abort:
            aborted.add(rid)

    def pages_add_up() -> None:
        held = sum(len(r.pages) - len(r.nodes) for r in sched.running)
        assert sched.kv.allocator.free_count + held + sched.kv.cache.nodes == pages

    got = run_aborting_to_end(sched, model, aborted, pages_add_up)
    assert not (sched.running or sched.waiting)
    for rid, tokens in got.items():
        assert tokens == expected[rid][: len(tokens)]
    assert sched.kv.available == pages
