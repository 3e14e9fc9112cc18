"""LFU: keeps the experts requested most, protects the current layer, beats LRU on cyclic decode."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.services.worker.offload.slot_cache.frequency_policy import LFUExpertPolicy
from ferry.services.worker.offload.slot_cache.policy import NO_SLOT, LRUExpertPolicy


def test_the_least_requested_expert_is_evicted_ties_to_the_least_recent():
    p = LFUExpertPolicy(num_layers=2, num_experts=3, num_slots=4)
    p.lookup(0, [0, 1, 2])
    p.lookup(0, [0, 1])  # requests: (0,0)=2 (0,1)=2 (0,2)=1
    p.lookup(1, [0])  # the last free slot; (1,0)=1, more recent than (0,2)
    got = p.lookup(1, [1])
    assert got.evictions == ((0, 2),)  # fewest requests; tie with (1,0) broken by recency
    got = p.lookup(1, [2])
    assert got.evictions == ((1, 0),)


def test_requests_count_for_experts_that_are_not_resident():
    p = LFUExpertPolicy(num_layers=2, num_experts=2, num_slots=2)
    for _ in range(3):
        p.lookup(0, [0])
        p.lookup(1, [1])  # evicts (0,1)... whichever has fewer requests
    assert p.requests[0, 0] == 3 and p.requests[1, 1] == 3


def test_warm_up_placement_is_not_a_request():
    p = LFUExpertPolicy(num_layers=1, num_experts=3, num_slots=3)
    assert p.place_in_free_slot(0, 1) is not None
    assert p.requests[0, 1] == 0 and p.lookups == 0 and p.misses == 0
    assert p.lookup(0, [1]).hits == 1 and p.requests[0, 1] == 1


def test_counts_halve_every_half_life():
    p = LFUExpertPolicy(num_layers=1, num_experts=2, num_slots=2, half_life=4)
    for _ in range(3):
        p.lookup(0, [0])
    assert p.requests[0, 0] == 3
    p.lookup(0, [0])  # the 4th lookup halves first, then counts
    assert p.requests[0, 0] == 2.5


def test_current_layer_is_protected_even_when_it_has_the_fewest_requests():
    p = LFUExpertPolicy(num_layers=2, num_experts=4, num_slots=4)
    for _ in range(5):
        p.lookup(0, [0, 1, 2, 3])  # layer 0 is hot and fills the cache
    got = p.lookup(1, [0, 1, 2, 3])  # all four of layer 1 must fit: evicts all of layer 0
    assert len(got.evictions) == 4 and all(p.slot_of[1, e] != NO_SLOT for e in range(4))


def _decode_hit_rate(policy_cls, seed=0, layers=8, experts=32, top_k=4, batch=4, slots=64, steps=300):
    """Cyclic decode with skewed routing whose working set per step exceeds the cache."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, experts + 1)
    p_layer = [rng.permutation(popularity / popularity.sum()) for _ in range(layers)]
    policy = policy_cls(layers, experts, slots)
    for _ in range(steps):
        for layer in range(layers):
            routed = {int(e) for _ in range(batch) for e in rng.choice(experts, top_k, replace=False, p=p_layer[layer])}
            policy.lookup(layer, sorted(routed))
    return policy.counters()["hit_rate"]


def test_lfu_beats_lru_when_a_step_does_not_fit():
    lru, lfu = _decode_hit_rate(LRUExpertPolicy), _decode_hit_rate(LFUExpertPolicy)
    assert lru < 0.1  # the cyclic pathology: almost every lookup misses
    assert lfu > lru + 0.3


@settings(max_examples=60, deadline=None)
@given(
    num_layers=st.integers(1, 4),
    num_experts=st.integers(1, 6),
    extra_slots=st.integers(0, 8),
    half_life=st.integers(1, 10),
    requests=st.lists(st.tuples(st.integers(0, 3), st.sets(st.integers(0, 5), min_size=1)), max_size=40),
)
def test_maps_stay_consistent_and_the_layer_is_protected(num_layers, num_experts, extra_slots, half_life, requests):
    slots = num_experts + extra_slots
    p = LFUExpertPolicy(num_layers, num_experts, slots, half_life=half_life)
    for layer, experts in requests:
        layer %= num_layers
        experts = sorted({e % num_experts for e in experts})
        got = p.lookup(layer, experts)
        assert all(p.slot_of[layer, e] == s for e, s in zip(experts, got.slots))
        assert len(set(got.slots)) == len(got.slots)
        assert not {(layer, e) for e in experts} & set(got.evictions)
        for s in range(slots):
            if p.layer_of_slot[s] != NO_SLOT:
                assert p.slot_of[p.layer_of_slot[s], p.expert_of_slot[s]] == s
        assert int((p.slot_of != NO_SLOT).sum()) == p.resident


def test_bad_half_life_is_refused():
    with pytest.raises(ValueError, match="half_life"):
        LFUExpertPolicy(1, 2, 2, half_life=0)
