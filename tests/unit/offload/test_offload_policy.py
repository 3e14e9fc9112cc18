"""The LRU slot policy: eviction order, protection of the current layer's experts, map consistency, counters."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.services.worker.offload.slot_cache.policy import NO_SLOT, ExpertSlotPolicy, LRUExpertPolicy


def is_resident(p: ExpertSlotPolicy, layer: int, expert: int) -> bool:
    return bool(p.slot_of[layer, expert] != NO_SLOT)


def lru_order(p: LRUExpertPolicy) -> list[tuple[int, int]]:
    """Resident (layer, expert) pairs, the next victim first (the oldest stamp)."""
    occupied = np.flatnonzero(p.layer_of_slot != NO_SLOT)
    return [(int(p.layer_of_slot[s]), int(p.expert_of_slot[s])) for s in occupied[np.argsort(p.stamp[occupied])]]


def test_free_slots_first_then_least_recent_is_evicted():
    p = LRUExpertPolicy(num_layers=3, num_experts=4, num_slots=4)
    first = p.lookup(0, [2, 0])  # taken in ascending expert order
    assert first.misses == ((0, 0), (2, 1)) and first.evictions == ()
    p.lookup(1, [3, 1])  # fills slots 2, 3; recency now: (0,0) (0,2) (1,1) (1,3)
    p.lookup(0, [2])  # hit: (0,2) becomes most recent
    assert lru_order(p) == [(0, 0), (1, 1), (1, 3), (0, 2)]
    got = p.lookup(2, [1, 2])
    assert got.evictions == ((0, 0), (1, 1))  # the two least recent, in order
    assert got.misses == ((1, 0), (2, 2))  # the slot of (0,0) went to the first miss, of (1,1) to the second
    assert not is_resident(p, 0, 0) and not is_resident(p, 1, 1)
    assert lru_order(p) == [(1, 3), (0, 2), (2, 1), (2, 2)]


def test_hits_of_the_current_layer_are_never_evicted_by_its_own_misses():
    p = LRUExpertPolicy(num_layers=2, num_experts=4, num_slots=4)
    p.lookup(0, [0, 1, 2, 3])  # the whole cache is layer 0, expert 0 least recent
    got = p.lookup(1, [0])  # evicts (0,0)
    assert got.evictions == ((0, 0),)
    assert lru_order(p) == [(0, 1), (0, 2), (0, 3), (1, 0)]
    # layer 0 now needs 0 (a miss) and 1, 2 (hits, yet the two least recent slots): the miss
    # must not take the slot of 1 or 2, so (0,3) is the victim
    got = p.lookup(0, [0, 1, 2])
    assert got.evictions == ((0, 3),)
    assert is_resident(p, 0, 1) and is_resident(p, 0, 2) and is_resident(p, 0, 0)


def test_a_full_layer_fits_in_the_minimum_cache():
    p = LRUExpertPolicy(num_layers=3, num_experts=5, num_slots=5)
    for layer in (0, 1, 2, 0):
        got = p.lookup(layer, [4, 3, 2, 1, 0])
        assert sorted(got.slots) == [0, 1, 2, 3, 4]
        assert all(is_resident(p, layer, e) for e in range(5))


def test_counters_and_hit_rate():
    p = LRUExpertPolicy(num_layers=2, num_experts=3, num_slots=6)
    p.lookup(0, [0, 1])
    p.lookup(0, [1, 2])
    p.lookup(1, [0])
    c = p.counters()
    assert (c["lookups"], c["hits"], c["misses"], c["evictions"], c["resident"]) == (3, 1, 4, 0, 4)
    assert c["hit_rate"] == pytest.approx(1 / 5)


def test_a_cache_holding_every_expert_never_misses_after_warm_up():
    p = LRUExpertPolicy(num_layers=2, num_experts=3, num_slots=6)
    for layer in range(2):
        for e in range(3):
            assert p.place_in_free_slot(layer, e) is not None
    assert p.place_in_free_slot(0, 0) is None  # already resident
    rng = np.random.default_rng(0)
    for _ in range(50):
        layer = int(rng.integers(2))
        got = p.lookup(layer, rng.choice(3, size=2, replace=False))
        assert got.misses == () and got.evictions == ()
    assert p.misses == 0 and p.hits == 100


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="at least 4 slots"):
        LRUExpertPolicy(num_layers=2, num_experts=4, num_slots=3)
    p = LRUExpertPolicy(num_layers=2, num_experts=4, num_slots=4)
    with pytest.raises(ValueError, match="duplicates"):
        p.lookup(0, [1, 1])
    with pytest.raises(IndexError):
        p.lookup(2, [0])
    with pytest.raises(IndexError):
        p.lookup(0, [4])


class _ReferenceLRU:
    """The obvious LRU over (layer, expert) keys, to compare the slot policy with."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.order: list[tuple[int, int]] = []  # least recent first

    def lookup(self, layer, experts):
        keys = [(layer, e) for e in experts]
        hits = [k for k in keys if k in self.order]
        for k in hits:
            self.order.remove(k)
            self.order.append(k)
        evicted = []
        for k in keys:
            if k in self.order:
                continue
            if len(self.order) == self.capacity:
                victim = next(v for v in self.order if v not in keys)
                self.order.remove(victim)
                evicted.append(victim)
            self.order.append(k)
        return evicted


@settings(max_examples=60, deadline=None)
@given(
    num_layers=st.integers(1, 4),
    num_experts=st.integers(1, 6),
    extra_slots=st.integers(0, 10),
    requests=st.lists(st.tuples(st.integers(0, 3), st.sets(st.integers(0, 5), min_size=1)), max_size=40),
)
def test_matches_a_reference_lru_and_keeps_the_maps_consistent(num_layers, num_experts, extra_slots, requests):
    slots = num_experts + extra_slots
    p = LRUExpertPolicy(num_layers, num_experts, slots)
    ref = _ReferenceLRU(slots)
    hits = misses = 0
    for layer, experts in requests:
        layer %= num_layers
        experts = sorted({e % num_experts for e in experts})
        got = p.lookup(layer, experts)
        assert list(got.evictions) == ref.lookup(layer, experts)
        assert lru_order(p) == ref.order
        hits, misses = hits + got.hits, misses + len(got.misses)
        # every requested expert is resident where the lookup says, and no two share a slot
        for e, s in zip(experts, got.slots):
            assert p.slot_of[layer, e] == s
            assert (p.layer_of_slot[s], p.expert_of_slot[s]) == (layer, e)
        assert len(set(got.slots)) == len(got.slots)
        # slot_of and its inverse agree everywhere
        for s in range(slots):
            if p.layer_of_slot[s] != NO_SLOT:
                assert p.slot_of[p.layer_of_slot[s], p.expert_of_slot[s]] == s
        assert int((p.slot_of != NO_SLOT).sum()) == p.resident == len(ref.order)
    assert (p.hits, p.misses) == (hits, misses)


def test_a_scan_evicts_the_layers_it_has_passed_first():
    """A prefill reads every layer's experts once, in order: evicting a passed layer's experts
    (least recent or not) is right, evicting the next layer's is a copy paid twice."""
    p = LRUExpertPolicy(num_layers=3, num_experts=2, num_slots=4)
    p.lookup(2, [0, 1])  # oldest: layer 2, about to be read again by the scan
    p.lookup(0, [0, 1])
    got = p.lookup(1, [0, 1], evict_below=1)
    assert got.evictions == ((0, 0), (0, 1))  # layer 0's, though layer 2's are older
    plain = LRUExpertPolicy(num_layers=3, num_experts=2, num_slots=4)
    plain.lookup(2, [0, 1])
    plain.lookup(0, [0, 1])
    assert plain.lookup(1, [0, 1]).evictions == ((2, 0), (2, 1))
