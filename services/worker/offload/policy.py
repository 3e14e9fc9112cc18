"""Which expert lives in which GPU slot: pure replacement policies over S slots shared by all MoE layers.

No torch and no device here, only bookkeeping, so every path is tested on CPU (DESIGN §3). The
mechanism (`expert_cache.py`) asks `lookup(layer, experts)` for the unique experts a layer's
tokens were routed to, and gets back the slot of each and the misses it must copy before
computing. Experts requested by the current lookup are protected: a miss of the layer never
evicts another expert that the same layer is about to use, so one layer's routed experts all
fit together as long as S >= num_experts (the planner's floor).

`ExpertSlotPolicy` keeps the maps, the free slots and the counters; a subclass only says which
slots to evict (`_victims`) and what a use means to it (`_touched`). LRU is here;
`frequency_policy.py` holds LFU, which suits the cyclic layer-by-layer access of decode better
once a step's working set exceeds the cache (LRU then evicts exactly what the next layers need).
"""

from __future__ import annotations

from collections import OrderedDict, deque
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
        self._free: deque[int] = deque(range(num_slots))
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.lookups = 0

    # ---- what a subclass decides -----------------------------------------------------------
    def _touched(self, layer: int, expert: int, slot: int) -> None:
        """(layer, expert) in `slot` was just requested (a hit, or a miss now placed)."""
        raise NotImplementedError

    def _victims(self, protected: set[int], count: int) -> list[int]:
        """`count` occupied slots outside `protected` to evict, the first victim first."""
        raise NotImplementedError

    def _forget(self, slot: int) -> None:
        """`slot` was just emptied."""

    # ---- queries ---------------------------------------------------------------------------
    @property
    def resident(self) -> int:
        return self.num_slots - len(self._free)

    def is_resident(self, layer: int, expert: int) -> bool:
        return bool(self.slot_of[layer, expert] != NO_SLOT)

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
        }

    # ---- the lookup ------------------------------------------------------------------------
    def lookup(self, layer: int, experts: Iterable[int]) -> Lookup:
        """Map the unique `experts` routed in `layer` to slots, choosing a slot for each miss.

        Hits are touched first and every slot of this lookup is protected, so the layer's own
        experts are never victims of its own misses."""
        experts = tuple(int(e) for e in experts)
        self._check_request(layer, experts)
        self.lookups += 1
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
            self._touched(layer, e, s)
        # every victim is chosen before any miss is placed: the policy sees this lookup's hits
        # as protected and as just used, and nothing of this lookup's misses yet
        needed = max(0, len(missing) - len(self._free))
        victims = self._victims(protected, needed) if needed else []
        if (len(victims) != needed or len(set(victims)) != needed or protected.intersection(victims)
                or any(self.layer_of_slot[v] == NO_SLOT for v in victims)):  # fmt: skip
            raise RuntimeError(f"{self.name} policy chose victims {victims} for {needed} misses, protected {protected}")
        victims.reverse()  # popped from the end: first victim first
        misses, evictions = [], []
        for i in missing:
            if self._free:
                s = self._free.popleft()
            else:
                s = victims.pop()
                evictions.append((int(self.layer_of_slot[s]), int(self.expert_of_slot[s])))
                self.slot_of[evictions[-1]] = NO_SLOT
                self._forget(s)
            self._place(layer, experts[i], s)
            protected.add(s)
            slots[i] = s
            misses.append((experts[i], s))
        self.hits += len(experts) - len(missing)
        self.misses += len(missing)
        self.evictions += len(evictions)
        return Lookup(layer, experts, tuple(slots), tuple(misses), tuple(evictions))

    def place_in_free_slot(self, layer: int, expert: int) -> int | None:
        """Warm-up: give (layer, expert) a free slot without evicting anything and without
        counting a miss; None when no slot is free or it is already resident."""
        self._check_request(layer, (expert,))
        if not self._free or self.slot_of[layer, expert] != NO_SLOT:
            return None
        s = self._free.popleft()
        self._place(layer, expert, s)
        return s

    # ---- internals -------------------------------------------------------------------------
    def _check_request(self, layer: int, experts: tuple[int, ...]) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"MoE layer {layer} out of range [0, {self.num_layers})")
        bad = [e for e in experts if not 0 <= e < self.num_experts]
        if bad:
            raise IndexError(f"experts {bad} out of range [0, {self.num_experts}) in MoE layer {layer}")
        if len(set(experts)) != len(experts):
            raise ValueError(f"lookup wants unique experts, got duplicates in {list(experts)}")

    def _place(self, layer: int, expert: int, s: int) -> None:
        self.slot_of[layer, expert] = s
        self.layer_of_slot[s] = layer
        self.expert_of_slot[s] = expert
        self._touched(layer, expert, s)


class LRUExpertPolicy(ExpertSlotPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self, num_layers: int, num_experts: int, num_slots: int):
        super().__init__(num_layers, num_experts, num_slots)
        self._recency: OrderedDict[int, None] = OrderedDict()  # occupied slots, least recent first

    def lru_order(self) -> list[tuple[int, int]]:
        """Resident (layer, expert) pairs, the next victim first."""
        return [(int(self.layer_of_slot[s]), int(self.expert_of_slot[s])) for s in self._recency]

    def _touched(self, layer: int, expert: int, slot: int) -> None:
        self._recency[slot] = None
        self._recency.move_to_end(slot)

    def _victims(self, protected: set[int], count: int) -> list[int]:
        out = []
        for s in self._recency:  # least recent first; protected slots were just touched, so are last
            if len(out) == count:
                break
            if s not in protected:
                out.append(s)
        return out

    def _forget(self, slot: int) -> None:
        del self._recency[slot]
