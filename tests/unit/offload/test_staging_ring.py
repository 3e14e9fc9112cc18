"""The staging ring of a streamed prefill (services/worker/offload/host_memory/staging_ring.py), on CPU: every
staged expert is copied into a free slot before its chunk is handed out, chunks come in layer
order, a slot is reused only once its chunk was released, and a layer asked out of order is refused."""

from __future__ import annotations

import pytest
import torch

from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.host_memory.staging_ring import StagingRing


def _banks(layers: int, experts: int):
    w13 = [torch.arange(experts * 4, dtype=torch.float32).view(experts, 2, 2) + 100 * layer for layer in range(layers)]
    w2 = [-t for t in w13]
    return HostBanks(w13, w2)


def test_chunks_come_in_layer_order_with_their_experts_copied():
    banks = _banks(4, 9)
    ring = StagingRing(torch.zeros(4, 2, 2), torch.zeros(4, 2, 2), banks, None, chunk=2)
    staged = [[0, 1, 2], [3], [], [4, 5, 6, 7, 8]]
    ring.begin(staged)
    seen = []
    for layer in range(4):
        while (chunk := ring.take(layer)) is not None:
            assert chunk.layer == layer and len(chunk.experts) <= 2
            for e, s in zip(chunk.experts, chunk.slots):
                assert torch.equal(ring.w13[s], banks.w13[layer][e]) and torch.equal(ring.w2[s], banks.w2[layer][e])
            seen.append((layer, chunk.experts))
            ring.release(chunk, None)
    assert seen == [(0, [0, 1]), (0, [2]), (1, [3]), (3, [4, 5]), (3, [6, 7]), (3, [8])]
    assert ring.staged_total == 9


def test_a_slot_is_not_reused_before_its_chunk_is_released():
    ring = StagingRing(torch.zeros(2, 2, 2), torch.zeros(2, 2, 2), _banks(1, 6), None, chunk=2)
    ring.begin([[0, 1, 2, 3]])
    first = ring.take(0)
    with pytest.raises(RuntimeError, match="release the chunk taken before"):
        ring.take(0)  # the second chunk would need the slots the first still holds
    ring.release(first, None)
    second = ring.take(0)
    assert second.experts == [2, 3] and sorted(second.slots) == sorted(first.slots)


def test_a_layer_asked_before_an_earlier_layer_is_done_is_refused():
    ring = StagingRing(torch.zeros(4, 2, 2), torch.zeros(4, 2, 2), _banks(2, 6), None, chunk=2)
    ring.begin([[0, 1, 2], [3]])
    ring.release(ring.take(0), None)  # layer 0 still has expert 2 staged
    with pytest.raises(RuntimeError, match="computes before layer 0"):
        ring.take(1)


def test_a_new_step_takes_back_the_slots_of_a_step_that_stopped_midway():
    ring = StagingRing(torch.zeros(2, 2, 2), torch.zeros(2, 2, 2), _banks(1, 6), None, chunk=2)
    ring.begin([[0, 1, 2, 3]])
    ring.take(0)  # never released: the step failed
    ring.begin([[4, 5]])
    chunk = ring.take(0)
    assert chunk.experts == [4, 5]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="--prefill-ring-chunk 3: a chunk must fit the 2 staging slots"):
        StagingRing(torch.zeros(2, 2, 2), torch.zeros(2, 2, 2), _banks(1, 2), None, chunk=3)


def test_a_chunk_fills_consecutive_slots_of_one_bay_and_knows_its_place_in_the_layer():
    banks = _banks(1, 12)
    ring = StagingRing(torch.zeros(6, 2, 2), torch.zeros(6, 2, 2), banks, None, chunk=3)  # two bays of 3
    ring.begin([[0, 1, 2, 5, 7, 8, 9]])
    firsts = []
    while (chunk := ring.take(0)) is not None:
        assert chunk.slots == list(range(chunk.slots[0], chunk.slots[0] + len(chunk.experts)))
        assert chunk.slots[0] % 3 == 0
        for e, s in zip(chunk.experts, chunk.slots):
            assert torch.equal(ring.w13[s], banks.w13[0][e])
        firsts.append(chunk.first)
        ring.release(chunk, None)
    assert firsts == [0, 3, 6]


def test_lent_cache_slots_are_bays_of_that_step_only():
    banks = _banks(2, 10)
    cache13, cache2 = torch.zeros(6, 2, 2), torch.zeros(6, 2, 2)
    ring = StagingRing(torch.zeros(2, 2, 2), torch.zeros(2, 2, 2), banks, None, chunk=2)
    # slots 2..5 of the cache lent: two more bays, taken before the staging slots'
    ring.begin([[0, 1, 2, 3], [4, 5]], lent=(2, 4, (cache13, cache2)))
    held, used = [], []
    for layer in range(2):
        while (chunk := ring.take(layer)) is not None:
            w13 = chunk.bay.w13
            for e, s in zip(chunk.experts, chunk.slots):
                assert torch.equal(w13[s], banks.w13[layer][e]) and torch.equal(chunk.bay.w2[s], banks.w2[layer][e])
            used.append((chunk.bay.lent, chunk.slots))
            held.append(chunk)
            ring.release(chunk, None)
    assert used[:2] == [(True, [2, 3]), (True, [4, 5])] and (False, [0, 1]) in used
    assert ring.lent_total == 4
    # the next step lends nothing: only the staging slots' bay is used, and nothing counts as pending
    ring.begin([[6, 7, 8]])
    chunk = ring.take(0)
    assert not chunk.bay.lent and chunk.slots == [0, 1]
    ring.release(chunk, None)
    assert ring.take(0).slots == [0]


def test_a_step_that_lends_cuts_its_chunks_at_the_long_chunk_and_the_next_step_at_the_ring_s_own():
    banks = _banks(1, 20)
    cache13, cache2 = torch.zeros(8, 2, 2), torch.zeros(8, 2, 2)
    ring = StagingRing(torch.zeros(4, 2, 2), torch.zeros(4, 2, 2), banks, None, chunk=1, long_chunk=4)
    assert (ring.base_chunk, ring.long_chunk) == (1, 4)
    for lent, sizes in ((None, [1] * 6), ((0, 8, (cache13, cache2)), [4, 2]), (None, [1] * 6)):
        ring.begin([[0, 1, 2, 3, 4, 5]], lent=lent)
        got = []
        while (chunk := ring.take(0)) is not None:
            w13 = chunk.bay.w13
            assert all(torch.equal(w13[s], banks.w13[0][e]) for e, s in zip(chunk.experts, chunk.slots))
            got.append(len(chunk.experts))
            ring.release(chunk, None)
        assert got == sizes
    assert ring.lent_total == 8  # two lent bays of 4
    ring.use_chunks(2, 2)  # the benches' --ring-chunks
    ring.begin([[0, 1, 2]])
    assert len(ring.take(0).experts) == 2
    with pytest.raises(ValueError, match="does not fit 4 staging slots"):
        ring.use_chunks(5, 1)
    with pytest.raises(ValueError, match="--long-prefill-ring-chunk 5: a chunk must fit the 4 staging slots"):
        StagingRing(torch.zeros(4, 2, 2), torch.zeros(4, 2, 2), banks, None, long_chunk=5)
