"""LFU over the shared expert slots: evict the resident expert requested least often (decayed).

Decode visits the MoE layers in a cycle. Once one step's experts outnumber the slots, LRU
evicts the experts used longest ago, which are exactly those of the layers about to run: every
lookup misses. Routing is skewed and fairly stable per layer, so the number of times an expert
was requested predicts its next use far better. Counts cover every expert (resident or not),
so an expert that keeps coming back earns its place; they halve every `half_life` lookups so
the cache follows drifting traffic. Ties go to the least recently used slot (by lookup clock,
ages clamped at AGE_CLAMP lookups), then to the lowest slot.

Counts are float32, halved and incremented exactly as the device-side twin does it
(kernels/expert_cache_lookup.py), so both make the same decisions bit for bit.
"""

from __future__ import annotations

import numpy as np

from ferry.services.worker.offload.slot_cache.policy import ExpertSlotPolicy

AGE_CLAMP = 2**32 - 1


class LFUExpertPolicy(ExpertSlotPolicy):
    name = "lfu"

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, half_life: int | None = None):
        super().__init__(num_layers, num_experts, num_slots)
        # default: counts halve every 256 decode steps (a lookup per MoE layer per step)
        self.half_life = half_life if half_life is not None else 256 * num_layers
        if self.half_life < 1:
            raise ValueError(f"half_life must be at least 1 lookup, got {self.half_life}")
        self.requests = np.zeros((num_layers, num_experts), dtype=np.float32)
        self.last_use = np.zeros(num_slots, dtype=np.int64)  # the clock of the slot's last touch

    def _on_tick(self) -> None:
        if self.clock % self.half_life == 0:
            self.requests *= np.float32(0.5)

    def _on_hit(self, layer: int, expert: int, slot: int) -> None:
        self.requests[layer, expert] += np.float32(1.0)
        self.last_use[slot] = self.clock

    def _on_placed(self, layer: int, expert: int, slot: int, how: str) -> None:
        if how == "miss":  # a request; a prefetch or a warm-up placement is not
            self.requests[layer, expert] += np.float32(1.0)
        self.last_use[slot] = self.clock

    def _on_streamed(self, layer: int, expert: int) -> None:
        self.requests[layer, expert] += np.float32(1.0)  # a request, like a miss

    def _keys(self, slots: np.ndarray) -> np.ndarray:
        """requests' float32 bits above, then the clamped age inverted (older is smaller)."""
        score = self.requests[self.layer_of_slot[slots], self.expert_of_slot[slots]].view(np.int32).astype(np.int64)
        age = np.minimum(self.clock - self.last_use[slots], AGE_CLAMP)
        return (score << 32) | (AGE_CLAMP - age)
