"""The expert cache's decisions on the device: one single-program kernel per MoE layer.

`lookup` (MODE 0): for the routed expert ids [T, k] of one MoE layer it finds each distinct
expert's slot, chooses victims for the misses (never a slot this layer routed), rewrites the
slot map, its inverse and the replacement state, and writes for the expert GEMMs the slot of
every (token, k) pair split in two ([T, k] hits, [T, k] misses, -1 elsewhere) and the miss list
(expert, slot) with its count for the copy kernel (kernels/expert_copy.py). Nothing reaches the
host, so a whole decode step can be replayed as a CUDA graph.

`prefetch` (MODE 1): the same for a layer's *predicted* experts, before that layer runs: the
missing ones get slots (as far as slots outside the protected set allow) and are listed for
copying ahead; they count as neither hits nor misses, and are marked so that the next lookup of
their layer counts them as useful (routed) or wasted (not routed). With the host's share of decode
layers on (HAS_HOST), the host's part of the predicted experts without a slot gets none: the link
carries only the rest, and those come to their layer as misses that its hand-off gives the host
(kernels/expert_host_handoff.py: the same integer rule, in `host_count`).

`stream` (MODE 2): a lookup that places nothing (a prefill, which streams every non-resident
expert of the layer through staging slots outside the cache): hits as in a lookup, the routed
experts that are not resident requested but given no slot (their pairs get -1 in both outputs),
an empty list; counted as the twin's `stream_lookup` counts (the staged experts as prefetched).

The decisions are exactly those of the host policies (services/worker/offload/slot_cache/policy.py and
frequency_policy.py), which are this kernel's reference twin and are tested against it on the
same traces:
* misses and placements in ascending expert order; free slots first, lowest index first;
* victims in order of the eviction key, ties to the lowest slot:
  LFU: (requests[layer, expert] as float32, then least recently used, the age clamped at 2^32-1
  lookups); LRU: the stamp of the last touch (a global order: lookup hits, then lookup misses,
  then prefetch placements, each in ascending expert order);
* LFU counts halve every `half_life` lookups (float32, exactly as the twin does it).

One program does everything. The layer's expert-side state fits in registers (E experts up to 512); the
slots are read only when something is to be placed (most decode lookups hit: the prefetch placed their
experts), a tile of SLOT_TILE at a time, keeping each tile's least eviction key; a victim is the least of
those, and only its tile is read again for the next. Global scratch (flags per expert and per slot, the
slot assignment by rank) carries values between phases, with a barrier between; every scratch flag is
cleared before the program ends.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ferry.kernels.expert_host_handoff import host_count

LOOKUP, PREFETCH, STREAM = 0, 1, 2
LRU, LFU = 0, 1
# counters (int64): what the cache did since boot
LOOKUPS, HITS, MISSES, EVICTIONS, PREFETCHED, PREFETCH_USEFUL, PREFETCH_WASTED = range(7)
NUM_COUNTERS = 8
AGE_CLAMP = 2**32 - 1  # LFU's recency tie-break compares ages up to this many lookups
INT64_MAX = 2**63 - 1
# slots read at a time (registers hold a tile, not [S]); each victim after the first reads one tile again
SLOT_TILE = 4096


@triton.jit
def _eviction_keys(
    s, s_ok, owner, candidate, stamp_ptr, expert_of_slot_ptr, requests_ptr, clock, E, evict_below, POLICY: tl.constexpr
):
    """(group, key) of slots `s`: group 0 for a candidate of a layer below `evict_below`, 1 for another
    candidate, 2 for no candidate; key LFU's (requests as float32 bits, then least recently used) or LRU's stamp."""
    stamp = tl.load(stamp_ptr + s, mask=s_ok, other=0)
    if POLICY == 1:
        owner_expert = tl.load(expert_of_slot_ptr + s, mask=candidate, other=0)
        score = tl.load(requests_ptr + owner * E + owner_expert, mask=candidate, other=0.0)
        age = tl.minimum(clock - stamp, 4294967295)
        key = (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (4294967295 - age)
    else:
        key = stamp
    group = tl.where(candidate, tl.where(owner < evict_below, 0, 1), 2)
    return group, key


@triton.jit
def _least(group, key, s):
    """The least (group, key, slot) of a tile's slots `s` (group 2 where none is a candidate)."""
    g = tl.min(group, axis=0)
    k = tl.min(tl.where(group == g, key, 9223372036854775807), axis=0)
    least = tl.min(tl.where((group == g) & (key == k), s, 2147483647), axis=0)
    return g, k, least


# The step's token count and the layer vary from call to call: specialising on them (Triton's ==1 and
# multiple-of-16 classes) would compile new variants in the middle of serving, seconds each.
@triton.jit(do_not_specialize=["T", "layer", "evict_below"])
def _expert_cache_kernel(
    ids_ptr,
    n_rows_ptr,
    T,
    K,
    layer,
    slot_of_ptr,
    layer_of_slot_ptr,
    expert_of_slot_ptr,
    requests_ptr,
    stamp_ptr,
    prefetched_ptr,
    clock_ptr,
    counters_ptr,
    flags_ptr,
    protect_ptr,
    assign_ptr,
    evicted_ptr,
    evicted_stamp_ptr,
    hit_slots_ptr,
    miss_slots_ptr,
    list_ptr,
    count_ptr,
    guard_hits_ptr,
    guard_misses_ptr,
    host_costs_ptr,
    E,
    S,
    half_life,
    num_layers,
    evict_below,
    MODE: tl.constexpr,
    POLICY: tl.constexpr,
    HAS_GUARD: tl.constexpr,
    HAS_HOST: tl.constexpr,
    BLOCK_E: tl.constexpr,
    NUM_TILES: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    e_idx = tl.arange(0, BLOCK_E)
    e_ok = e_idx < E
    n_pairs = tl.load(n_rows_ptr) * K
    row_base = layer * E

    # ---- the clock (lookups only) and LFU's periodic halving -----------------------------
    clock = tl.load(clock_ptr)
    if MODE != 1:
        clock += 1
        tl.store(clock_ptr, clock)
        if POLICY == 1:
            if clock % half_life == 0:
                for start in range(0, num_layers * E, BLOCK_E):
                    r = start + e_idx
                    ok = r < num_layers * E
                    tl.store(requests_ptr + r, tl.load(requests_ptr + r, mask=ok) * 0.5, mask=ok)

    # ---- the distinct experts wanted: flags[e] = 1 (scatter; duplicates write the same value)
    for start in range(0, n_pairs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        ok = p < n_pairs
        e = tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int32)
        tl.store(flags_ptr + e, tl.full([BLOCK_P], 1, tl.int8), mask=ok)
    tl.debug_barrier()
    wanted = (tl.load(flags_ptr + e_idx, mask=e_ok, other=0) != 0) & e_ok
    cur = tl.load(slot_of_ptr + row_base + e_idx, mask=e_ok, other=-1)
    resident = cur >= 0
    hit = wanted & resident
    missing = wanted & ~resident
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    n_missing = tl.sum(missing.to(tl.int32), axis=0)
    miss_rank = tl.cumsum(missing.to(tl.int32), axis=0) - 1

    # ---- protected slots: this layer's hits (and for a prefetch, the layer being computed) ----
    safe_cur = tl.where(resident, cur, 0)
    tl.store(protect_ptr + safe_cur, tl.full([BLOCK_E], 1, tl.int8), mask=hit)
    if HAS_GUARD:  # prefetch: the slots of the lookup whose layer is computing now
        for start in range(0, T * K, BLOCK_P):
            p = start + tl.arange(0, BLOCK_P)
            ok = p < T * K
            gh = tl.load(guard_hits_ptr + p, mask=ok, other=-1)
            gm = tl.load(guard_misses_ptr + p, mask=ok, other=-1)
            tl.store(protect_ptr + gh, tl.full([BLOCK_P], 1, tl.int8), mask=ok & (gh >= 0))
            tl.store(protect_ptr + gm, tl.full([BLOCK_P], 1, tl.int8), mask=ok & (gm >= 0))
    tl.debug_barrier()

    # ---- prefetch bookkeeping of this layer's resident experts -------------------------------
    useful = 0
    wasted = 0
    if MODE != 1:
        pf = tl.load(prefetched_ptr + safe_cur, mask=resident & e_ok, other=0) != 0
        useful = tl.sum((pf & hit).to(tl.int32), axis=0)
        wasted = tl.sum((pf & resident & ~wanted & e_ok).to(tl.int32), axis=0)
        tl.store(prefetched_ptr + safe_cur, tl.zeros([BLOCK_E], tl.int8), mask=pf & resident & e_ok)

    # ---- how many want a slot: the misses (lookup), the predicted misses the link is to carry (prefetch) ----
    if MODE == 0:
        want = n_missing
    elif MODE == 1:
        want = n_missing
        if HAS_HOST:  # the host computes its share of them at their layer: they stay misses
            missing_pairs = tl.zeros([], tl.int64)
            for start in range(0, n_pairs, BLOCK_P):
                p = start + tl.arange(0, BLOCK_P)
                ok = p < n_pairs
                e = tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int32)
                no_slot = tl.load(slot_of_ptr + row_base + e, mask=ok, other=0) < 0
                missing_pairs += tl.sum((ok & no_slot).to(tl.int64), axis=0)
            total = n_missing.to(tl.int64)
            want = n_missing - host_count(total, total, missing_pairs, host_costs_ptr).to(tl.int32)
    else:
        want = n_missing * 0
    n_free = n_missing * 0
    n_place = n_missing * 0
    needed = n_missing * 0
    # The slots are read only when something is to be placed: most decode lookups hit (the prefetch placed
    # their experts), and reading every slot is most of the kernel's time. They are read a tile at a time
    # (a whole [S] block in one program spills registers): each tile's least eviction key is kept, a victim is
    # the least of those, and only its tile is read again for the next.
    if want > 0:
        t_idx = tl.arange(0, NUM_TILES)
        n_tiles = tl.cdiv(S, TILE)
        tile_g = tl.full([NUM_TILES], 2, tl.int32)
        tile_k = tl.full([NUM_TILES], 9223372036854775807, tl.int64)
        tile_s = tl.full([NUM_TILES], 2147483647, tl.int32)
        free_of_tile = tl.zeros([NUM_TILES], tl.int32)
        n_cand = n_missing * 0
        for t in range(0, n_tiles):
            s1 = t * TILE + tl.arange(0, TILE)
            ok = s1 < S
            owner = tl.load(layer_of_slot_ptr + s1, mask=ok, other=-1)
            candidate = (owner >= 0) & ok & (tl.load(protect_ptr + s1, mask=ok, other=0) == 0)
            free_of_tile = tl.where(t_idx == t, tl.sum(((owner < 0) & ok).to(tl.int32), axis=0), free_of_tile)
            n_cand += tl.sum(candidate.to(tl.int32), axis=0)
            group, key = _eviction_keys(
                s1, ok, owner, candidate, stamp_ptr, expert_of_slot_ptr, requests_ptr, clock, E, evict_below, POLICY
            )
            g, k, v = _least(group, key, s1)
            tile_g = tl.where(t_idx == t, g, tile_g)
            tile_k = tl.where(t_idx == t, k, tile_k)
            tile_s = tl.where(t_idx == t, v, tile_s)
        n_free = tl.sum(free_of_tile, axis=0)
        if MODE == 0:
            n_place = want
        else:
            n_place = tl.minimum(want, n_free + n_cand)
        needed = tl.maximum(n_place - n_free, 0)
        if n_free > 0:
            # slots by placement rank: the free ones first (lowest index first), then the victims in order
            free_before = tl.cumsum(free_of_tile, axis=0) - free_of_tile
            for t in range(0, n_tiles):
                s1 = t * TILE + tl.arange(0, TILE)
                free = (tl.load(layer_of_slot_ptr + s1, mask=s1 < S, other=0) < 0) & (s1 < S)
                base = tl.sum(tl.where(t_idx == t, free_before, 0), axis=0)
                rank = base + tl.cumsum(free.to(tl.int32), axis=0) - 1
                first_free = free & (rank < n_place)
                tl.store(assign_ptr + rank, s1, mask=first_free)
                tl.store(evicted_ptr + s1, tl.full([TILE], -1, tl.int32), mask=first_free)
        # victims: `needed` times the least (group, key, slot) among the candidates, group 0 the slots of
        # layers below `evict_below` (a prefill has passed them), 1 the rest
        for i in range(needed):
            g = tl.min(tile_g, axis=0)
            k = tl.min(tl.where(tile_g == g, tile_k, 9223372036854775807), axis=0)
            v = tl.min(tl.where((tile_g == g) & (tile_k == k), tile_s, 2147483647), axis=0)
            tl.store(assign_ptr + n_free + i, v)
            # the victim's tile offers its next candidate after (g, k, v)
            t = v // TILE
            s1 = t * TILE + tl.arange(0, TILE)
            ok = s1 < S
            owner = tl.load(layer_of_slot_ptr + s1, mask=ok, other=-1)
            candidate = (owner >= 0) & ok & (tl.load(protect_ptr + s1, mask=ok, other=0) == 0)
            group, key = _eviction_keys(
                s1, ok, owner, candidate, stamp_ptr, expert_of_slot_ptr, requests_ptr, clock, E, evict_below, POLICY
            )
            later = (group > g) | ((group == g) & ((key > k) | ((key == k) & (s1 > v))))
            ng, nk, ns = _least(tl.where(later, group, 2), key, s1)
            tile_g = tl.where(t_idx == t, ng, tile_g)
            tile_k = tl.where(t_idx == t, nk, tile_k)
            tile_s = tl.where(t_idx == t, ns, tile_s)
    tl.debug_barrier()

    # ---- evict ---------------------------------------------------------------------------
    vi = tl.arange(0, BLOCK_E)
    is_victim = vi < needed
    victims = tl.load(assign_ptr + n_free + vi, mask=is_victim, other=0)
    old_layer = tl.load(layer_of_slot_ptr + victims, mask=is_victim, other=0)
    old_expert = tl.load(expert_of_slot_ptr + victims, mask=is_victim, other=0)
    # what each victim held, for a miss handed to the host to give back (kernels/expert_host_handoff.py)
    tl.store(evicted_ptr + victims, old_layer * E + old_expert, mask=is_victim)
    tl.store(evicted_stamp_ptr + victims, tl.load(stamp_ptr + victims, mask=is_victim, other=0), mask=is_victim)
    victim_pf = tl.load(prefetched_ptr + victims, mask=is_victim, other=0) != 0
    wasted += tl.sum((victim_pf & is_victim).to(tl.int32), axis=0)
    tl.store(prefetched_ptr + victims, tl.zeros([BLOCK_E], tl.int8), mask=is_victim)
    tl.store(slot_of_ptr + old_layer * E + old_expert, tl.full([BLOCK_E], -1, tl.int32), mask=is_victim)

    # ---- place -----------------------------------------------------------------------------
    placed = missing & (miss_rank < n_place)
    new_slot = tl.load(assign_ptr + tl.where(placed, miss_rank, 0), mask=placed, other=-1)
    safe_new = tl.where(placed, new_slot, 0)
    tl.store(slot_of_ptr + row_base + e_idx, new_slot, mask=placed)
    tl.store(layer_of_slot_ptr + safe_new, tl.full([BLOCK_E], 0, tl.int32) + layer, mask=placed)
    tl.store(expert_of_slot_ptr + safe_new, e_idx, mask=placed)
    if POLICY == 1:
        tl.store(stamp_ptr + safe_new, tl.zeros([BLOCK_E], tl.int64) + clock, mask=placed)
    else:
        phase = 1 if MODE == 0 else 2
        tl.store(stamp_ptr + safe_new, clock * 3 * E + phase * E + e_idx, mask=placed)
    tl.store(list_ptr + 2 * miss_rank, e_idx, mask=placed)
    tl.store(list_ptr + 2 * miss_rank + 1, new_slot, mask=placed)
    tl.store(count_ptr, n_place)
    if MODE != 1:
        if POLICY == 1:
            tl.store(stamp_ptr + safe_cur, tl.zeros([BLOCK_E], tl.int64) + clock, mask=hit)
            r = tl.load(requests_ptr + row_base + e_idx, mask=wanted, other=0.0)
            tl.store(requests_ptr + row_base + e_idx, r + 1.0, mask=wanted)
        else:
            tl.store(stamp_ptr + safe_cur, clock * 3 * E + e_idx, mask=hit)
        # per expert: 1 hit, 2 miss (read back by the pairs below)
        tl.store(flags_ptr + e_idx, tl.where(hit, 1, 2).to(tl.int8), mask=wanted)
    else:
        tl.store(prefetched_ptr + safe_new, tl.full([BLOCK_E], 1, tl.int8), mask=placed)
    tl.debug_barrier()

    # ---- the slot of every (token, k) pair: hits and misses apart ---------------------------
    if MODE != 1:
        for start in range(0, T * K, BLOCK_P):
            p = start + tl.arange(0, BLOCK_P)
            in_range = p < T * K
            real = p < n_pairs
            e = tl.load(ids_ptr + p, mask=real, other=0).to(tl.int32)
            s = tl.load(slot_of_ptr + row_base + e, mask=real, other=-1)
            kind = tl.load(flags_ptr + e, mask=real, other=0)
            tl.store(hit_slots_ptr + p, tl.where(real & (kind == 1), s, -1), mask=in_range)
            tl.store(miss_slots_ptr + p, tl.where(real & (kind == 2), s, -1), mask=in_range)
    tl.debug_barrier()

    # ---- counters, then clear the scratch flags for the next call ----------------------------
    if MODE == 0:
        tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + 1)
        tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + n_hit)
        tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + n_missing)
        tl.store(counters_ptr + 5, tl.load(counters_ptr + 5) + useful)
    elif MODE == 2:  # every non-resident expert of the layer staged (none for a step of padding only)
        staged = tl.where(n_pairs > 0, E - tl.sum(resident.to(tl.int32), axis=0), 0)
        tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + 1)
        tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + n_hit + n_missing)
        tl.store(counters_ptr + 4, tl.load(counters_ptr + 4) + staged)
        tl.store(counters_ptr + 5, tl.load(counters_ptr + 5) + useful + n_missing)
        wasted += staged - n_missing
    else:
        tl.store(counters_ptr + 4, tl.load(counters_ptr + 4) + n_place)
    tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + needed)
    tl.store(counters_ptr + 6, tl.load(counters_ptr + 6) + wasted)
    tl.store(flags_ptr + e_idx, tl.zeros([BLOCK_E], tl.int8), mask=e_ok)
    # the protected flags were set at this layer's hit slots and the guard's slots alone: clear those
    tl.store(protect_ptr + safe_cur, tl.zeros([BLOCK_E], tl.int8), mask=hit)
    if HAS_GUARD:
        for start in range(0, T * K, BLOCK_P):
            p = start + tl.arange(0, BLOCK_P)
            ok = p < T * K
            gh = tl.load(guard_hits_ptr + p, mask=ok, other=-1)
            gm = tl.load(guard_misses_ptr + p, mask=ok, other=-1)
            tl.store(protect_ptr + gh, tl.zeros([BLOCK_P], tl.int8), mask=ok & (gh >= 0))
            tl.store(protect_ptr + gm, tl.zeros([BLOCK_P], tl.int8), mask=ok & (gm >= 0))


def block_sizes(num_experts: int, num_slots: int) -> tuple[int, int]:
    return triton.next_power_of_2(num_experts), triton.next_power_of_2(num_slots)


def launch(
    mode: int,
    policy: int,
    ids,
    n_rows,
    layer: int,
    state,
    out,
    guard=None,
    block_p: int = 256,
    evict_below: int = 0,
    host_costs=None,
    tile: int | None = None,
) -> None:
    """One lookup or prefetch over `state` (a DeviceCacheState's tensors) writing `out` (a
    CacheCallOutputs); `guard` = (hit_slots, miss_slots) of the layer being computed (prefetch);
    victims from layers below `evict_below` first (the twin's rule, policy.py); `host_costs` (prefetch
    only: the host's share's int64 costs, kernels/expert_host_handoff.py) leaves the host its share of
    the predicted experts without a slot, placing only the rest."""
    if host_costs is not None and mode != PREFETCH:
        raise ValueError("host_costs is for a prefetch: a lookup's misses go to the host through the hand-off")
    t, k = ids.shape
    block_e, block_s = block_sizes(state.num_experts, state.num_slots)
    tile = min(block_s, tile or SLOT_TILE)
    guard_hits, guard_misses = guard if guard is not None else (out.hit_slots, out.miss_slots)
    num_warps = max(4, min(16, tile // 256))  # 8 slots a thread: no spilled register at any mode or policy
    _expert_cache_kernel[(1,)](
        ids,
        n_rows,
        t,
        k,
        layer,
        state.slot_of,
        state.layer_of_slot,
        state.expert_of_slot,
        state.requests,
        state.stamp,
        state.prefetched,
        state.clock,
        state.counters,
        state.expert_flags,
        state.slot_flags,
        state.assign,
        state.evicted,
        state.evicted_stamp,
        out.hit_slots,
        out.miss_slots,
        out.misses,
        out.count,
        guard_hits,
        guard_misses,
        host_costs if host_costs is not None else state.counters,
        state.num_experts,
        state.num_slots,
        state.half_life,
        state.num_layers,
        evict_below,
        MODE=mode,
        POLICY=policy,
        HAS_GUARD=guard is not None,
        HAS_HOST=host_costs is not None,
        BLOCK_E=block_e,
        NUM_TILES=block_s // tile,
        TILE=tile,
        BLOCK_P=block_p,
        num_warps=num_warps,
    )
