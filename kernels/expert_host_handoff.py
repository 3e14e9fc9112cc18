"""The host's share of a decode layer's misses, decided on the device
(services/worker/offload/host_compute/decode_share.py).

After a layer's lookup (kernels/expert_cache_lookup.py) has listed its m missed experts with the slots it
gave them, this one-program kernel hands the last h of them to the host, so that the copies of the other
m - h and the host's computation of these end together:

    (q + m - h) x pcie  =  overhead + h x host(n),     host(n) = host_at_1 + host_per_token x (n - 1),

n being the missed pairs per missed expert and q the experts the previous layer's prefetch already put
on the link for this one (`in_flight`: the link is that much busier; 0 without a prefetch), integer
nanoseconds throughout, so the kernel and its twin agree to the unit; h is the balance point rounded down
or up, whichever gives the shorter layer (down leaves the link the longer side, up the host: on a
12-layer cut, 5 misses at 181 µs a copy against 137 on the host and a 63 µs hand-off end at 543
µs with 2 on the host, at 474 with 3), and 0 where the host would not make the layer shorter. The
prefetch leaves the host its share the same way (`host_count`, called by kernels/expert_cache_lookup.py): of P predicted
experts without a slot it places P - host_count(P) and the rest come here as misses. For each expert it hands on:

* its slot goes back to the expert the lookup evicted for it (`evicted`, `evicted_stamp`: written by the
  lookup for every slot it places into), whose weights are still there since nothing was copied over
  them, with that expert's stamp, and the eviction uncounted; a slot that was free is freed again;
* its pairs leave the miss slots (-1: no GPU kernel computes them), are marked in `host_pairs` [T * k]
  and listed, compacted in pair order, as (token row, expert, router weight) for the host;
* the lookup's count becomes m - h, what the copy kernel then moves.

The costs are read from a device tensor, not passed as launch arguments, so graphs captured at boot
follow the calibration that ends it (and the tests' costs).

`meta` gets [T, host pairs]: what the host node (kernels/host_experts_c/host_node.c) reads, with the
pair list, once both are copied to pinned memory. `totals` counts the experts and pairs handed over.
Everything has a fixed address and the launch a fixed shape: the kernel sits in the decode graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def host_count(total, cap, missed_pairs, costs_ptr):
    """How many of `total` experts (at most `cap` of them) the host computes while the link carries the
    rest, with `missed_pairs` pairs among them (host_count_reference is the twin)."""
    pcie_ns = tl.load(costs_ptr)
    host_at_1_ns = tl.load(costs_ptr + 1)
    host_per_token_ns = tl.load(costs_ptr + 2)
    overhead_ns = tl.load(costs_ptr + 3)
    per_expert = tl.maximum(missed_pairs // tl.maximum(total, 1), 1)
    host = host_at_1_ns + host_per_token_ns * (per_expert - 1)
    h = (total * pcie_ns - overhead_ns) // tl.maximum(pcie_ns + host, 1)
    h = tl.minimum(tl.maximum(h, 0), cap)
    # the balance point rounded down leaves the link the longer side, rounded up the host: the shorter wins
    up = tl.minimum(h + 1, cap)
    down_ns = tl.maximum((total - h) * pcie_ns, overhead_ns + h * host)
    up_ns = tl.maximum((total - up) * pcie_ns, overhead_ns + up * host)
    h = tl.where(up_ns < down_ns, up, h)
    with_host = tl.minimum(down_ns, up_ns)
    return tl.where((h > 0) & (with_host < total * pcie_ns), h, 0)


@triton.jit(do_not_specialize=["T", "layer"])
def _hand_to_host_kernel(
    ids_ptr,
    weights_ptr,
    n_rows_ptr,
    miss_slots_ptr,
    list_ptr,
    count_ptr,
    in_flight_ptr,
    slot_of_ptr,
    layer_of_slot_ptr,
    expert_of_slot_ptr,
    expert_flags_ptr,
    evicted_ptr,
    evicted_stamp_ptr,
    stamp_ptr,
    counters_ptr,
    host_pairs_ptr,
    pair_token_ptr,
    pair_expert_ptr,
    pair_weight_ptr,
    meta_ptr,
    totals_ptr,
    costs_ptr,
    T,
    K,
    E,
    layer,
    BLOCK_E: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    n_pairs = tl.load(n_rows_ptr) * K
    m = tl.load(count_ptr).to(tl.int64)
    q = tl.load(in_flight_ptr).to(tl.int64)
    # the missed pairs, for the pairs per missed expert
    missed_pairs = tl.zeros([], tl.int64)
    for start in range(0, T * K, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        s = tl.load(miss_slots_ptr + p, mask=p < n_pairs, other=-1)
        missed_pairs += tl.sum((s >= 0).to(tl.int64), axis=0)
    # as many pairs per expert for the prefetched ones as for the missed
    h = host_count(q + m, m, missed_pairs * (q + m) // tl.maximum(m, 1), costs_ptr)
    keep = m - h

    # the last h listed experts: their slots given back to what the lookup evicted for them (its weights
    # are still there: nothing was copied over them), or freed; the experts flagged for their pairs below
    i = tl.arange(0, BLOCK_E)
    mine = (i >= keep) & (i < m)
    e = tl.load(list_ptr + 2 * i, mask=mine, other=0)
    s = tl.load(list_ptr + 2 * i + 1, mask=mine, other=0)
    prev = tl.load(evicted_ptr + s, mask=mine, other=-1)
    back = mine & (prev >= 0)
    tl.store(slot_of_ptr + layer * E + e, tl.full([BLOCK_E], -1, tl.int32), mask=mine)
    tl.store(slot_of_ptr + prev, s, mask=back)
    tl.store(layer_of_slot_ptr + s, tl.where(back, prev // E, -1), mask=mine)
    tl.store(expert_of_slot_ptr + s, tl.where(back, prev % E, -1), mask=mine)
    tl.store(stamp_ptr + s, tl.load(evicted_stamp_ptr + s, mask=back, other=0), mask=back)
    tl.store(expert_flags_ptr + e, tl.full([BLOCK_E], 1, tl.int8), mask=mine)
    tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) - tl.sum(back.to(tl.int64), axis=0))  # not evicted after all
    tl.debug_barrier()

    # their pairs: out of the miss slots, listed for the host in pair order
    listed = tl.zeros([], tl.int64)
    for start in range(0, T * K, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        in_range = p < T * K
        real = p < n_pairs
        slot = tl.load(miss_slots_ptr + p, mask=real, other=-1)
        ex = tl.load(ids_ptr + p, mask=real, other=0).to(tl.int32)
        flag = tl.load(expert_flags_ptr + ex, mask=real & (slot >= 0), other=0)
        is_host = real & (slot >= 0) & (flag != 0)
        at = listed + tl.cumsum(is_host.to(tl.int64), axis=0) - 1
        tl.store(pair_token_ptr + at, (p // K).to(tl.int64), mask=is_host)
        tl.store(pair_expert_ptr + at, ex.to(tl.int64), mask=is_host)
        tl.store(pair_weight_ptr + at, tl.load(weights_ptr + p, mask=is_host, other=0.0).to(tl.float32), mask=is_host)
        tl.store(miss_slots_ptr + p, tl.where(is_host, -1, slot), mask=real)
        tl.store(host_pairs_ptr + p, is_host.to(tl.int8), mask=in_range)
        listed += tl.sum(is_host.to(tl.int64), axis=0)
    tl.debug_barrier()

    tl.store(expert_flags_ptr + e, tl.zeros([BLOCK_E], tl.int8), mask=mine)  # the lookup's scratch, cleared
    tl.store(count_ptr, keep.to(tl.int32))
    tl.store(meta_ptr, tl.zeros([], tl.int64) + T)
    tl.store(meta_ptr + 1, listed)
    tl.store(totals_ptr, tl.load(totals_ptr) + h)
    tl.store(totals_ptr + 1, tl.load(totals_ptr + 1) + listed)


def hand_to_host(
    ids, weights, n_rows, miss_slots, misses, count, in_flight, cache, layer: int, costs_ns: torch.Tensor, out
) -> None:
    """One layer's hand-off (module docstring). `ids`, `weights` [T, k] (contiguous), `n_rows` [1],
    `miss_slots` [T * k] and the layer's list `misses` [E, 2] and `count` [1] from its lookup, `in_flight`
    int32 [1] the experts its prefetch placed (the prefetch's count; zeros without one), `cache` the
    DeviceExpertCache whose maps it frees, `costs_ns` int64 [4] on the device (pcie, host at 1 token,
    host per more token, overhead: read at run time, so a captured graph follows a new calibration);
    `out` the HostDecodeBuffers it writes (host_pairs, pair_token, pair_expert, pair_weight, meta, totals)."""
    t, k = ids.shape
    _hand_to_host_kernel[(1,)](
        ids,
        weights,
        n_rows,
        miss_slots,
        misses,
        count,
        in_flight,
        cache.slot_of,
        cache.layer_of_slot,
        cache.expert_of_slot,
        cache.expert_flags,
        cache.evicted,
        cache.evicted_stamp,
        cache.stamp,
        cache.counters,
        out.host_pairs,
        out.pair_token,
        out.pair_expert,
        out.pair_weight,
        out.meta,
        out.totals,
        costs_ns,
        t,
        k,
        cache.num_experts,
        layer,
        BLOCK_E=triton.next_power_of_2(cache.num_experts),
        BLOCK_P=256,
    )


def host_count_reference(total: int, missed_pairs: int, costs_ns, cap: int | None = None) -> int:
    """How many of `total` experts (at most `cap`) the host takes: the kernels' integer rule (host_count)."""
    pcie, at_1, per_token, overhead = (int(c) for c in costs_ns)
    per_expert = max(missed_pairs // max(total, 1), 1)
    host = at_1 + per_token * (per_expert - 1)
    cap = total if cap is None else cap
    h = min(max((total * pcie - overhead) // max(pcie + host, 1), 0), cap)

    def layer_ns(n: int) -> int:  # the layer's longer side with n experts on the host
        return max((total - n) * pcie, overhead + n * host)

    h = min((h, min(h + 1, cap)), key=layer_ns)  # rounded down or up: the shorter (down on a tie)
    return h if h > 0 and layer_ns(h) < total * pcie else 0


def hand_to_host_reference(
    ids, weights, n_rows, miss_slots, misses, count, in_flight, cache, layer: int, costs_ns: torch.Tensor, out
) -> None:
    """The kernel's twin, in torch on the same tensors (the tests hold one to the other)."""
    t, k = ids.shape
    n_pairs = int(n_rows[0]) * k
    m, q = int(count[0]), int(in_flight[0])
    real = miss_slots[:n_pairs]
    h = host_count_reference(q + m, int((real >= 0).sum()) * (q + m) // max(m, 1), costs_ns, cap=m)
    keep = m - h
    experts = misses[keep:m, 0].long()
    slots = misses[keep:m, 1].long()
    cache.slot_of[layer, experts] = -1
    prev = cache.evicted[slots].long()
    back = prev >= 0
    e_total = cache.num_experts
    cache.slot_of.view(-1)[prev[back]] = slots[back].to(cache.slot_of.dtype)
    cache.layer_of_slot[slots] = torch.where(back, prev // e_total, -1).to(cache.layer_of_slot.dtype)
    cache.expert_of_slot[slots] = torch.where(back, prev % e_total, -1).to(cache.expert_of_slot.dtype)
    cache.stamp[slots[back]] = cache.evicted_stamp[slots[back]]
    cache.counters[3] -= int(back.sum())
    flat_ids = ids.reshape(-1)[:n_pairs].long()
    is_host = (real >= 0) & torch.isin(flat_ids, experts)
    where = is_host.nonzero().flatten()
    n = where.numel()
    out.pair_token[:n] = where // k
    out.pair_expert[:n] = flat_ids[where]
    out.pair_weight[:n] = weights.reshape(-1)[where].float()
    miss_slots[:n_pairs] = torch.where(is_host, torch.full_like(real, -1), real)
    out.host_pairs[: t * k] = 0
    out.host_pairs[:n_pairs] = is_host.to(out.host_pairs.dtype)
    count[0] = keep
    out.meta[0], out.meta[1] = t, n
    out.totals[0] += h
    out.totals[1] += n
