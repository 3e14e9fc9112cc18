"""Which expert lives in which GPU slot: pure replacement policies over S slots shared by all MoE layers.

No torch and no device here, only bookkeeping, so every path is tested on CPU (docs/ARCHITECTURE.md §3). The
mechanism (`stores/offloaded.py`) asks `lookup(layer, experts)` for the unique experts a layer's
tokens were routed to, and gets back the slot of each and the misses it must copy before
computing. Experts requested by the current lookup are protected: a miss of the layer never
evicts another expert that the same layer is about to use, so one layer's routed experts all
fit together as long as S >= num_experts (the planner's floor).

`ExpertSlotPolicy` keeps the maps, the free slots and the counters; a subclass only gives each
occupied slot an eviction key (`_keys`: the least key goes first, ties to the lowest slot) and
says what a use means to it (the `_on_*` hooks). LRU is here; `frequency_policy.py` holds LFU,
which suits the cyclic layer-by-layer access of decode better once a step's working set exceeds
the cache (LRU then evicts exactly what the next layers need).

These objects are also the reference twin of the device-side cache (kernels/expert_cache_lookup.py),
which makes the same decisions on the GPU and is tested against them on the same traces: that is
why the order of everything is spelled out (experts ascending; free slots lowest first; victims by
key, then slot), why LRU keeps integer stamps rather than a list, and why LFU counts in float32.
`prefetch` places a layer's predicted experts ahead of its lookup (the next-layer prefetch of
docs/ARCHITECTURE.md §3); the next lookup of that layer counts each as useful (routed) or wasted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

import numpy as np

NO_SLOT = -1


@dataclass(frozen=True)
class Lookup:
    """The answer for one layer: `slots[i]` is where `experts[i]` lives (after the misses are copied)."""

    layer: int
    experts: tuple[int, ...]
    slots: tuple[int, ...]
    misses: tuple[tuple[int, int], ...]  # (expert, slot): copy host bank -> slot before computing
    evictions: tuple[tuple[int, int], ...]  # (layer, expert) that lost its slot to this lookup

    @property
    def hits(self) -> int:
        return len(self.experts) - len(self.misses)


class ExpertSlotPolicy:
    """Maps and counters common to every policy over `num_slots` slots for `num_layers` x
    `num_experts` experts. `slot_of[layer, expert]` is the slot holding that expert or NO_SLOT;
    `layer_of_slot[s]` and `expert_of_slot[s]` are its inverse (NO_SLOT for a free slot). Free
    slots are used before any eviction, lowest index first."""

    name = "base"

    def __init__(self, num_layers: int, num_experts: int, num_slots: int):
        if num_layers <= 0 or num_experts <= 0:
            raise ValueError(f"need at least one MoE layer and one expert, got {num_layers} x {num_experts}")
        if num_slots < num_experts:
            raise ValueError(
                f"{num_slots} expert slots cannot hold one MoE layer's {num_experts} experts at once; "
                f"the offload loop needs at least {num_experts} slots"
            )
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.slot_of = np.full((num_layers, num_experts), NO_SLOT, dtype=np.int64)
        self.layer_of_slot = np.full(num_slots, NO_SLOT, dtype=np.int64)
        self.expert_of_slot = np.full(num_slots, NO_SLOT, dtype=np.int64)
        self.prefetched = np.zeros(num_slots, dtype=bool)  # placed by prefetch, not yet looked up
        self._free: deque[int] = deque(range(num_slots))
        self.clock = 0  # lookups so far
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.lookups = 0
        self.prefetched_total = 0
        self.prefetch_useful = 0
        self.prefetch_wasted = 0

    # ---- what a subclass decides -----------------------------------------------------------
    def _keys(self, slots: np.ndarray) -> np.ndarray:
        """int64 eviction keys of these occupied slots: the least is evicted first."""
        raise NotImplementedError

    def _on_tick(self) -> None:
        """A lookup began (self.clock was just advanced)."""

    def _on_hit(self, layer: int, expert: int, slot: int) -> None:
        raise NotImplementedError

    def _on_placed(self, layer: int, expert: int, slot: int, how: str) -> None:
        """(layer, expert) was just put in `slot`; how: "miss", "prefetch" or "warm-up"."""
        raise NotImplementedError

    def _on_streamed(self, layer: int, expert: int) -> None:
        """(layer, expert) was routed but not resident, and streamed past the cache (`stream_lookup`)."""

    # ---- queries ---------------------------------------------------------------------------
    @property
    def resident(self) -> int:
        return self.num_slots - len(self._free)

    def counters(self) -> dict[str, int | float | str]:
        total = self.hits + self.misses
        return {
            "policy": self.name,
            "lookups": self.lookups,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "hit_rate": self.hits / total if total else 0.0,
            "resident": self.resident,
            "slots": self.num_slots,
            "prefetched": self.prefetched_total,
            "prefetch_useful": self.prefetch_useful,
            "prefetch_wasted": self.prefetch_wasted,
        }

    # ---- the lookup ------------------------------------------------------------------------
    def lookup(self, layer: int, experts: Iterable[int], evict_below: int = 0) -> Lookup:
        """Map the distinct `experts` routed in `layer` to slots, choosing a slot for each miss.

        Hits are touched first and every slot of this lookup is protected, so the layer's own
        experts are never victims of its own misses. `evict_below` L: victims come from the
        experts of layers below L first (a prefill step has passed them and will not need them
        again; the layers after it will need theirs: a scan through every layer's experts should
        not evict what it is about to read)."""
        experts = self._begin_lookup(layer, experts)
        protected: set[int] = set()
        slots = [NO_SLOT] * len(experts)
        missing = []
        for i, e in enumerate(experts):
            s = int(self.slot_of[layer, e])
            if s == NO_SLOT:
                missing.append(i)
                continue
            slots[i] = s
            protected.add(s)
        self._judge_prefetched(layer, protected)
        placed, evictions = self._place(layer, [experts[i] for i in missing], protected, "miss", evict_below)
        for i, (_, s) in zip(missing, placed):
            slots[i] = s
        for i, e in enumerate(experts):  # hits touched once the victims are chosen (they were protected)
            if i not in missing:
                self._on_hit(layer, e, slots[i])
        self.hits += len(experts) - len(missing)
        self.misses += len(missing)
        return Lookup(layer, experts, tuple(slots), tuple(placed), tuple(evictions))

    def stream_lookup(self, layer: int, experts: Iterable[int]) -> Streamed:
        """A lookup that places nothing, for a step that routes to (nearly) every expert of every
        layer (a prefill): the store streams *every* expert of `layer` that is not resident through
        staging slots outside the cache, routed or not, so the scan evicts nothing the decode and
        the layers after it use. Hits are touched as by `lookup`; a routed expert that is not
        resident is a request (LFU counts it) but takes no slot. Counted like a prefetch that was
        used: the layer's non-resident experts as prefetched, the routed ones among them as useful
        and as hits (as a prefetched expert is when its layer looks), the rest as wasted. A step
        of padding rows only (no experts) stages nothing."""
        experts = self._begin_lookup(layer, experts)
        slots = tuple(int(self.slot_of[layer, e]) for e in experts)
        self._judge_prefetched(layer, {s for s in slots if s != NO_SLOT})
        streamed = tuple(e for e, s in zip(experts, slots) if s == NO_SLOT)
        for e, s in zip(experts, slots):
            if s == NO_SLOT:
                self._on_streamed(layer, e)
            else:
                self._on_hit(layer, e, s)
        staged = self.num_experts - int((self.slot_of[layer] != NO_SLOT).sum()) if experts else 0  # padding only
        self.hits += len(experts)
        self.prefetched_total += staged
        self.prefetch_useful += len(streamed)
        self.prefetch_wasted += staged - len(streamed)
        return Streamed(layer, experts, slots, streamed, staged)

    def _begin_lookup(self, layer: int, experts: Iterable[int]) -> tuple[int, ...]:
        """The distinct experts, sorted and checked; the clock ticks once per lookup."""
        experts = tuple(sorted(int(e) for e in experts))
        self._check_request(layer, experts)
        self.clock += 1
        self._on_tick()
        self.lookups += 1
        return experts

    def _judge_prefetched(self, layer: int, used_slots: set[int]) -> None:
        """The experts prefetched for `layer` are judged when it looks: useful if it uses them, else wasted."""
        for s in np.flatnonzero((self.layer_of_slot == layer) & self.prefetched).tolist():
            if s in used_slots:
                self.prefetch_useful += 1
            else:
                self.prefetch_wasted += 1
            self.prefetched[s] = False

    def prefetch(
        self,
        layer: int,
        experts: Iterable[int],
        protected_slots: Iterable[int] = (),
        evict_below: int = 0,
        left_to_host: int = 0,
    ) -> Prefetch:
        """Give the predicted `experts` of `layer` slots ahead of its lookup, evicting nothing in
        `protected_slots` (the layer computing meanwhile) nor `layer`'s resident predicted experts.
        As many as the unprotected slots allow, in ascending expert order, but the last `left_to_host`
        of those without a slot (the host computes them: kernels/expert_host_handoff.py); nothing is touched."""
        experts = tuple(sorted(int(e) for e in experts))
        self._check_request(layer, experts)
        protected = {int(s) for s in protected_slots}
        protected |= {int(self.slot_of[layer, e]) for e in experts if self.slot_of[layer, e] != NO_SLOT}
        missing = [e for e in experts if self.slot_of[layer, e] == NO_SLOT]
        candidates = int(((self.layer_of_slot != NO_SLOT) & ~np.isin(np.arange(self.num_slots), list(protected))).sum())
        missing = missing[: min(len(missing) - left_to_host, len(self._free) + candidates)]
        placed, evictions = self._place(layer, missing, protected, "prefetch", evict_below)
        for _, s in placed:
            self.prefetched[s] = True
        self.prefetched_total += len(placed)
        return Prefetch(layer, tuple(placed), tuple(evictions))

    def place_in_free_slot(self, layer: int, expert: int) -> int | None:
        """Warm-up: give (layer, expert) a free slot without evicting anything and without
        counting a miss; None when no slot is free or it is already resident."""
        self._check_request(layer, (expert,))
        if not self._free or self.slot_of[layer, expert] != NO_SLOT:
            return None
        s = self._free.popleft()
        self._set(layer, expert, s)
        self._on_placed(layer, expert, s, "warm-up")
        return s

    # ---- internals -------------------------------------------------------------------------
    def _victims(self, protected: set[int], count: int, evict_below: int = 0) -> list[int]:
        """`count` occupied slots outside `protected`: those of layers below `evict_below` first,
        then the rest; within each, the least key first (ties: lowest slot)."""
        occupied = np.flatnonzero(self.layer_of_slot != NO_SLOT)
        candidates = occupied[~np.isin(occupied, list(protected))]
        later = self.layer_of_slot[candidates] >= evict_below
        order = np.lexsort((candidates, self._keys(candidates), later))  # passed layers, then key, then slot
        return [int(s) for s in candidates[order[:count]]]

    def _place(self, layer: int, experts: list[int], protected: set[int], how: str, evict_below: int = 0):
        """Slots for `experts` (ascending): free ones first (lowest first), then victims chosen
        all at once before any is placed. Returns ((expert, slot), ...) and the evictions."""
        needed = max(0, len(experts) - len(self._free))
        victims = self._victims(protected, needed, evict_below) if needed else []
        if len(victims) != needed:
            raise RuntimeError(
                f"{self.name} policy found {len(victims)} victims for {needed} misses, protected {protected}"
            )
        victims.reverse()  # popped from the end: first victim first
        placed, evictions = [], []
        for e in experts:
            if self._free:
                s = self._free.popleft()
            else:
                s = victims.pop()
                evicted = (int(self.layer_of_slot[s]), int(self.expert_of_slot[s]))
                evictions.append(evicted)
                self.slot_of[evicted] = NO_SLOT
                if self.prefetched[s]:  # prefetched and evicted before its layer looked
                    self.prefetch_wasted += 1
                    self.prefetched[s] = False
            self._set(layer, e, s)
            self._on_placed(layer, e, s, how)
            placed.append((e, s))
        self.evictions += len(evictions)
        return placed, evictions

    def _check_request(self, layer: int, experts: tuple[int, ...]) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"MoE layer {layer} out of range [0, {self.num_layers})")
        bad = [e for e in experts if not 0 <= e < self.num_experts]
        if bad:
            raise IndexError(f"experts {bad} out of range [0, {self.num_experts}) in MoE layer {layer}")
        if len(set(experts)) != len(experts):
            raise ValueError(f"lookup wants unique experts, got duplicates in {list(experts)}")

    def _set(self, layer: int, expert: int, s: int) -> None:
        self.slot_of[layer, expert] = s
        self.layer_of_slot[s] = layer
        self.expert_of_slot[s] = expert


class LRUExpertPolicy(ExpertSlotPolicy):
    """Least recently used first. Recency is a stamp per slot, increasing with every touch: in
    a lookup at clock c, hits get 3·E·c + e, misses 3·E·c + E + e, prefetch placements after it
    3·E·c + 2·E + e (warm-up placements negative stamps, in placement order), so the order of
    stamps is the order of touches."""

    name = "lru"

    def __init__(self, num_layers: int, num_experts: int, num_slots: int):
        super().__init__(num_layers, num_experts, num_slots)
        self.stamp = np.zeros(num_slots, dtype=np.int64)
        self._warm_stamp = -num_slots

    def _keys(self, slots: np.ndarray) -> np.ndarray:
        return self.stamp[slots]

    def _on_hit(self, layer: int, expert: int, slot: int) -> None:
        self.stamp[slot] = 3 * self.num_experts * self.clock + expert

    def _on_placed(self, layer: int, expert: int, slot: int, how: str) -> None:
        if how == "warm-up":
            self.stamp[slot] = self._warm_stamp
            self._warm_stamp += 1
            return
        phase = 1 if how == "miss" else 2
        self.stamp[slot] = 3 * self.num_experts * self.clock + phase * self.num_experts + expert


@dataclass(frozen=True)
class Streamed:
    """A `stream_lookup`: `slots[i]` holds `experts[i]` (NO_SLOT for the streamed ones); `staged`: how
    many experts of the layer were not resident, every one of which the store streams."""

    layer: int
    experts: tuple[int, ...]
    slots: tuple[int, ...]
    streamed: tuple[int, ...]
    staged: int


@dataclass(frozen=True)
class Prefetch:
    """What a prefetch placed: (expert, slot) to copy ahead of the layer's lookup."""

    layer: int
    placed: tuple[tuple[int, int], ...]
    evictions: tuple[tuple[int, int], ...]
