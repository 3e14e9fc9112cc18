"""The device-side expert cache (Triton, through the interpreter on CPU) makes exactly the host
policies' decisions on the same traces: maps, victims, replacement state, prefetch bookkeeping,
miss lists and the slots handed to the expert GEMMs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferry.kernels.expert_host_handoff import host_count_reference
from ferry.services.worker.offload.slot_cache.device_cache import DeviceExpertCache
from ferry.services.worker.offload.slot_cache.frequency_policy import LFUExpertPolicy
from ferry.services.worker.offload.slot_cache.policy import NO_SLOT, LRUExpertPolicy
from tests.unit.offload.offload_tiny import slot_pool, tiny_spec


def _twins(policy_name: str, layers: int, experts: int, slots: int, top_k: int, half_life: int = 7, warm: int = 0):
    spec = tiny_spec(layers=layers, experts=experts, top_k=top_k)
    host = (
        LFUExpertPolicy(layers, experts, slots, half_life=half_life)
        if policy_name == "lfu"
        else LRUExpertPolicy(layers, experts, slots)
    )
    for i in range(warm):  # boot's warm-up placements
        host.place_in_free_slot(i % layers, (i * 3) % experts)
    return host, DeviceExpertCache(slot_pool(spec, slots, max_step_tokens=16), host)


def _assert_same_state(host, dev: DeviceExpertCache) -> None:
    snap = dev.snapshot()
    assert np.array_equal(snap["slot_of"], host.slot_of)
    assert np.array_equal(snap["layer_of_slot"], host.layer_of_slot)
    assert np.array_equal(snap["expert_of_slot"], host.expert_of_slot)
    assert np.array_equal(snap["prefetched"].astype(bool), host.prefetched)
    assert int(snap["clock"][0]) == host.clock
    occupied = host.layer_of_slot != NO_SLOT
    if isinstance(host, LFUExpertPolicy):
        assert np.array_equal(snap["requests"], host.requests)  # float32, bit for bit
        assert np.array_equal(snap["stamp"][occupied], host.last_use[occupied])
    else:
        assert np.array_equal(snap["stamp"][occupied], host.stamp[occupied])
    c = host.counters()
    got = dev.counters_dict(snap["counters"])
    for name in ("lookups", "hits", "misses", "evictions", "prefetch_useful", "prefetch_wasted"):
        assert got[name] == c[name], name
    assert got["prefetched"] == c["prefetched"]


def _ids(rng, rows: int, experts: int, top_k: int, skew: float) -> torch.Tensor:
    p = np.arange(1, experts + 1, dtype=np.float64) ** -skew
    return torch.tensor(
        np.stack([rng.choice(experts, top_k, replace=False, p=p / p.sum()) for _ in range(rows)]), dtype=torch.int64
    )


# tile: the kernel's slot tile; None (its default) keeps every slot in one tile, 2 spreads the slots over up to 8
# tiles, so victims come from several. One tile is the same kernel code with one tile: two traces cover it (the
# fewest slots, one layer's worth, and 12 of 16 experts); the rest run over several tiles, the harder victim search
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize(
    "seed, layers, experts, slots, top_k, rows, tile",
    [
        (0, 3, 6, 6, 2, 2, None),
        (2, 2, 8, 12, 2, 5, None),
        (1, 3, 6, 9, 3, 4, 2),
        (3, 4, 5, 13, 2, 3, 2),
        (4, 3, 8, 8, 4, 4, 2),
    ],
)
def test_device_cache_makes_the_twins_decisions(policy, seed, layers, experts, slots, top_k, rows, tile):
    rng = np.random.default_rng(seed)
    host, dev = _twins(policy, layers, experts, slots, top_k, warm=slots // 2)
    dev.slot_tile = tile
    _assert_same_state(host, dev)
    for step in range(6):
        real = int(rng.integers(1, rows + 1))
        for layer in range(layers):
            ids = _ids(rng, rows, experts, top_k, skew=1.0)
            n_rows = torch.tensor([real], dtype=torch.int32)
            below = layer if step % 3 == 1 else 0  # some steps scan: the passed layers' experts go first
            call = dev.lookup(layer, ids, n_rows, evict_below=below)
            got = host.lookup(layer, np.unique(ids[:real].numpy()), evict_below=below)
            # the miss list, in ascending expert order, and its count
            n = int(call.count[0])
            assert n == len(got.misses)
            assert [tuple(r) for r in call.misses[:n].tolist()] == list(got.misses)
            # the slot of every real pair, split into hits and misses; padding rows get -1
            slot_of = dict(zip(got.experts, got.slots))
            missed = {e for e, _ in got.misses}
            flat = ids.reshape(-1).tolist()
            for p, e in enumerate(flat):
                want = slot_of[e] if p < real * top_k else -1
                assert int(call.hit_slots[p]) == (want if e not in missed else -1) or p >= real * top_k
                assert int(call.miss_slots[p]) == (want if e in missed else -1) or p >= real * top_k
                if p >= real * top_k:
                    assert int(call.hit_slots[p]) == int(call.miss_slots[p]) == -1
            _assert_same_state(host, dev)
            if layer + 1 < layers and step % 2 == 0:  # prefetch the next layer, guarding this one
                predicted = _ids(rng, rows, experts, top_k, skew=1.0)
                # steps 2 and 4 with the host's decode share: its part of the predicted misses stays off the link
                costs, left = None, 0
                if step in (2, 4):
                    costs = torch.tensor([1000, 1, 0, 0] if step == 2 else rng.integers(1, 1200, 4).tolist())
                    no_slot = host.slot_of[layer + 1, predicted[:real].numpy()] == NO_SLOT
                    distinct = len(np.unique(predicted[:real].numpy()[no_slot]))
                    left = host_count_reference(distinct, int(no_slot.sum()), costs)
                pcall = dev.prefetch(layer + 1, predicted, n_rows, call, evict_below=below, host_costs=costs)
                pgot = host.prefetch(
                    layer + 1, np.unique(predicted[:real].numpy()), got.slots, evict_below=below, left_to_host=left
                )
                pn = int(pcall.count[0])
                assert [tuple(r) for r in pcall.misses[:pn].tolist()] == list(pgot.placed)
                assert not set(s for _, s in pgot.placed) & set(got.slots)
                _assert_same_state(host, dev)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_prefetch_leaves_the_host_its_share_of_the_predicted_misses(policy):
    """With the host's decode share on, a copy costing 1000 ns and the host 300: of 4 predicted experts
    without a slot the host computes 3 at their layer (1,200 ns against the link's 1,000 for the fourth),
    so the prefetch places only the first."""
    host, dev = _twins(policy, 2, 8, 8, 4)
    n = torch.tensor([1], dtype=torch.int32)
    call = dev.lookup(0, torch.tensor([[0, 1, 2, 3]]), n)
    got = host.lookup(0, [0, 1, 2, 3])
    costs = torch.tensor([1000, 300, 0, 0])
    predicted = torch.tensor([[6, 2, 5, 4]])
    assert host_count_reference(4, 4, costs) == 3
    pcall = dev.prefetch(1, predicted, n, call, host_costs=costs)
    pgot = host.prefetch(1, [2, 4, 5, 6], got.slots, left_to_host=3)
    assert int(pcall.count[0]) == len(pgot.placed) == 1
    assert [tuple(r) for r in pcall.misses[:1].tolist()] == list(pgot.placed) and pgot.placed[0][0] == 2
    _assert_same_state(host, dev)
    # the host's rule says nothing for a slow host: every predicted expert crosses
    pcall = dev.prefetch(1, torch.tensor([[7, 3, 1, 0]]), n, call, host_costs=torch.tensor([1000, 5000, 0, 0]))
    pgot = host.prefetch(1, [0, 1, 3, 7], got.slots)
    assert int(pcall.count[0]) == len(pgot.placed) == 4
    _assert_same_state(host, dev)
    with pytest.raises(ValueError, match="host_costs is for a prefetch"):
        from ferry.kernels.expert_cache_lookup import LOOKUP, launch

        launch(LOOKUP, dev.policy_code, predicted, n, 1, dev, dev._call(1, predicted, LOOKUP), host_costs=costs)


def test_the_lookup_and_prefetch_lists_of_each_layer_are_their_own():
    host, dev = _twins("lfu", 3, 6, 9, 2)
    one = torch.tensor([[0, 1]])
    n = torch.tensor([1], dtype=torch.int32)
    first = dev.lookup(0, one, n)
    dev.lookup(1, torch.tensor([[2, 3]]), n)
    assert first.misses[:2].tolist() == [[0, 0], [1, 1]]  # layer 1's lookup wrote its own list
    assert dev.lookup_misses[1, :2].tolist() == [[2, 2], [3, 3]]


def test_lfu_counts_halve_on_the_device_as_on_the_host():
    host, dev = _twins("lfu", 2, 4, 5, 2, half_life=3)
    n = torch.tensor([1], dtype=torch.int32)
    for _ in range(7):
        dev.lookup(0, torch.tensor([[0, 1]]), n)
        host.lookup(0, [0, 1])
    _assert_same_state(host, dev)
    assert float(dev.requests[0, 0]) == host.requests[0, 0] == np.float32(4.0)  # 1 2 |1+1 3 4 |2+1 4


def test_bad_calls_are_refused():
    _, dev = _twins("lru", 2, 6, 6, 2)
    n = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(IndexError):
        dev.lookup(2, torch.tensor([[0, 1]]), n)
    with pytest.raises(ValueError, match="at most"):
        dev.lookup(0, torch.zeros(200, 2, dtype=torch.int64), n)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("seed, layers, experts, slots, top_k, rows", [(5, 3, 6, 7, 2, 4), (6, 2, 8, 10, 3, 6)])
def test_a_stream_lookup_makes_the_twins_decisions_and_places_nothing(
    policy, seed, layers, experts, slots, top_k, rows
):
    """Prefill steps (stream lookups) between decode steps (lookups and prefetches): same state,
    same counters; a stream lookup gives the hits their slots and every other pair -1, and leaves
    the maps as they were."""
    rng = np.random.default_rng(seed)
    host, dev = _twins(policy, layers, experts, slots, top_k, warm=slots)
    for step in range(6):
        real = int(rng.integers(1, rows + 1))
        n_rows = torch.tensor([real], dtype=torch.int32)
        for layer in range(layers):
            ids = _ids(rng, rows, experts, top_k, skew=0.5)
            wanted = np.unique(ids[:real].numpy())
            if step % 2 == 1:
                maps = host.slot_of.copy()
                call = dev.stream_lookup(layer, ids, n_rows)
                got = host.stream_lookup(layer, wanted)
                assert np.array_equal(host.slot_of, maps)
                assert got.staged == int((maps[layer] == NO_SLOT).sum())
                assert set(got.streamed) == {e for e in wanted if maps[layer, e] == NO_SLOT}
                for p, e in enumerate(ids.reshape(-1).tolist()):
                    want = int(maps[layer, e]) if p < real * top_k else -1
                    assert int(call.hit_slots[p]) == want and int(call.miss_slots[p]) == -1
                assert int(call.count[0]) == 0
            else:
                call = dev.lookup(layer, ids, n_rows)
                got = host.lookup(layer, wanted)
                if layer + 1 < layers:
                    predicted = _ids(rng, rows, experts, top_k, skew=0.5)
                    dev.prefetch(layer + 1, predicted, n_rows, call)
                    host.prefetch(layer + 1, np.unique(predicted[:real].numpy()), got.slots)
            _assert_same_state(host, dev)
    c = host.counters()
    assert c["prefetched"] >= c["prefetch_useful"] > 0


def test_a_stream_lookup_of_padding_only_stages_nothing():
    host, dev = _twins("lfu", 2, 6, 7, 2, warm=4)
    dev.stream_lookup(0, torch.tensor([[0, 1], [2, 3]]), torch.tensor([0], dtype=torch.int32))
    got = host.stream_lookup(0, [])
    assert got.staged == 0
    _assert_same_state(host, dev)
    assert host.prefetched_total == 0
