"""LFU over the shared expert slots: evict the resident expert requested least often (decayed).

Decode visits the MoE layers in a cycle. Once one step's experts outnumber the slots, LRU
evicts the experts used longest ago, which are exactly those of the layers about to run: every
lookup misses. Routing is skewed and fairly stable per layer, so the number of times an expert
was requested predicts its next use far better. Counts cover every expert (resident or not),
so an expert that keeps coming back earns its place; they halve every `half_life` lookups so
the cache follows drifting traffic. Ties go to the least recently used slot.
"""

from __future__ import annotations

import numpy as np

from ferry.services.worker.offload.policy import NO_SLOT, ExpertSlotPolicy


class LFUExpertPolicy(ExpertSlotPolicy):
    name = "lfu"

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, half_life: int | None = None):
        super().__init__(num_layers, num_experts, num_slots)
        # default: counts halve every 256 decode steps (a lookup per MoE layer per step)
        self.half_life = half_life if half_life is not None else 256 * num_layers
        if self.half_life < 1:
            raise ValueError(f"half_life must be at least 1 lookup, got {self.half_life}")
        self.requests = np.zeros((num_layers, num_experts), dtype=np.float64)
        self._last_use = np.zeros(num_slots, dtype=np.int64)
        self._clock = 0

    def lookup(self, layer, experts):
        self._clock += 1
        if self._clock % self.half_life == 0:
            self.requests *= 0.5
        return super().lookup(layer, experts)

    def place_in_free_slot(self, layer: int, expert: int) -> int | None:
        s = super().place_in_free_slot(layer, expert)
        if s is not None:
            self.requests[layer, expert] -= 1.0  # a warm-up placement is not a request
        return s

    def _touched(self, layer: int, expert: int, slot: int) -> None:
        self.requests[layer, expert] += 1.0
        self._last_use[slot] = self._clock

    def _victims(self, protected: set[int], count: int) -> list[int]:
        score = self.requests[self.layer_of_slot, self.expert_of_slot]
        score[self.layer_of_slot == NO_SLOT] = np.inf  # free slots are taken before any victim
        if protected:
            score[list(protected)] = np.inf
        # only slots scoring at most the count-th lowest can be victims: sort just those (this
        # runs on the host while the GPU waits, once per layer with misses)
        if count < score.size:
            candidates = np.flatnonzero(score <= np.partition(score, count - 1)[count - 1])
        else:
            candidates = np.arange(score.size)
        order = np.lexsort((self._last_use[candidates], score[candidates]))  # fewest requests, then least recent
        return [int(s) for s in candidates[order[:count]]]
