"""The expert cache driven from the device: slot map, inverse map and replacement state in GPU memory.

`DeviceExpertCache` wraps the state tensors that the expert pool carries when it offloads
(pool_layout.expert_cache_state: priced with the slots, allocated with them) and launches
kernels/expert_cache_lookup.py over them. It starts from a host policy (the reference twin,
after the boot's warm-up placed experts in the free slots) and from then on the device alone
decides; the host reads only counters, after a step, with the step's results.

Per MoE layer: `lookup` writes the layer's [T, k] hit and miss slots (shared buffers: the
expert GEMMs read them in stream order before the next layer's lookup) and the layer's own miss
list and count (per layer: the copy stream may still be reading an earlier layer's list);
`prefetch` writes a layer's own prefetch list and count. Everything has a fixed address, so the
calls can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferry.kernels.expert_cache_lookup import (
    EVICTIONS,
    HITS,
    LFU,
    LOOKUP,
    LOOKUPS,
    LRU,
    MISSES,
    NUM_COUNTERS,
    PREFETCH,
    PREFETCH_USEFUL,
    PREFETCH_WASTED,
    PREFETCHED,
    STREAM,
    launch,
)
from ferry.services.worker.offload.slot_cache.frequency_policy import LFUExpertPolicy
from ferry.services.worker.offload.slot_cache.policy import ExpertSlotPolicy, LRUExpertPolicy
from ferry.services.worker.pools import ExpertSlotPool


@dataclass
class CacheCall:
    """What one lookup or prefetch hands on: the pairs' slots ([T*k] views; lookup only) and the
    (expert, slot) list with its count for the copy kernel."""

    hit_slots: torch.Tensor  # int32 [T * k]: slot of each pair that hit, -1 elsewhere
    miss_slots: torch.Tensor  # int32 [T * k]: slot of each pair that missed, -1 elsewhere
    misses: torch.Tensor  # int32 [E, 2]
    count: torch.Tensor  # int32 [1]


class DeviceExpertCache:
    def __init__(self, slots: ExpertSlotPool, policy: ExpertSlotPolicy):
        st = slots.cache_state
        if not st:
            raise ValueError("this expert pool has no cache state: it was laid out for every expert resident")
        if isinstance(policy, LFUExpertPolicy):
            self.policy_code, self.half_life = LFU, policy.half_life
        elif isinstance(policy, LRUExpertPolicy):
            self.policy_code, self.half_life = LRU, 1
        else:
            raise ValueError(f"no device twin for the {policy.name} policy")
        self.name = policy.name
        self.num_layers, self.num_experts, self.num_slots = policy.num_layers, policy.num_experts, policy.num_slots
        if tuple(st["slot_of"].shape) != (self.num_layers, self.num_experts) or st["stamp"].shape[0] != self.num_slots:
            raise ValueError("the pool's cache state was laid out for another model or slot count")
        self.slot_of, self.requests = st["slot_of"], st["requests"]
        self.layer_of_slot, self.expert_of_slot, self.stamp = st["layer_of_slot"], st["expert_of_slot"], st["stamp"]
        self.prefetched, self.slot_flags, self.assign = st["prefetched"], st["slot_flags"], st["assign"]
        self.expert_flags, self.clock, self.counters = st["expert_flags"], st["clock"], st["counters"]
        self.evicted, self.evicted_stamp = st["evicted"], st["evicted_stamp"]
        self.hit_slots, self.miss_slots = st["hit_slots"], st["miss_slots"]
        self.lookup_misses, self.lookup_count = st["lookup_misses"], st["lookup_count"]
        self.prefetch_misses, self.prefetch_count = st["prefetch_misses"], st["prefetch_count"]
        self.copy_stamps = st["copy_stamps"]
        self.max_pairs = self.hit_slots.shape[0]
        self.slot_tile: int | None = None  # the kernel's slot tile (None: its default); tests make it small
        self.load_from(policy)

    # ---- state -------------------------------------------------------------------------------
    def load_from(self, policy: ExpertSlotPolicy) -> None:
        """Take the twin's state (boot: after the warm-up placements)."""

        def put(dst: torch.Tensor, src) -> None:
            dst.copy_(torch.as_tensor(np.asarray(src)).to(dst.dtype).reshape(dst.shape))

        put(self.slot_of, policy.slot_of)
        put(self.layer_of_slot, policy.layer_of_slot)
        put(self.expert_of_slot, policy.expert_of_slot)
        put(self.prefetched, policy.prefetched)
        if self.policy_code == LFU:
            put(self.requests, policy.requests)
            put(self.stamp, policy.last_use)
        else:
            self.requests.zero_()
            put(self.stamp, policy.stamp)
        self.clock.fill_(policy.clock)
        c = np.zeros(NUM_COUNTERS, dtype=np.int64)
        c[[LOOKUPS, HITS, MISSES, EVICTIONS, PREFETCHED, PREFETCH_USEFUL, PREFETCH_WASTED]] = [
            policy.lookups,
            policy.hits,
            policy.misses,
            policy.evictions,
            policy.prefetched_total,
            policy.prefetch_useful,
            policy.prefetch_wasted,
        ]
        put(self.counters, c)
        for t in (self.slot_flags, self.expert_flags):
            t.zero_()

    def snapshot(self) -> dict[str, np.ndarray]:
        """The state on the host (tests, reports): maps, replacement state, counters."""
        names = ("slot_of", "layer_of_slot", "expert_of_slot", "requests", "stamp", "prefetched", "clock", "counters")
        return {n: getattr(self, n).cpu().numpy().copy() for n in names}

    # ---- the calls ---------------------------------------------------------------------------
    def lookup(self, layer: int, topk_ids: torch.Tensor, n_rows: torch.Tensor, evict_below: int = 0) -> CacheCall:
        """Hits, misses and the miss list of MoE layer `layer` for the first n_rows[0] rows of
        topk_ids [T, k] (later rows are padding: their pairs get slot -1 in both outputs); victims
        from layers below `evict_below` first (a prefill's passed layers, policy.py)."""
        call = self._call(layer, topk_ids, LOOKUP)
        launch(
            LOOKUP, self.policy_code, topk_ids, n_rows, layer, self, call, evict_below=evict_below, tile=self.slot_tile
        )
        return call

    def stream_lookup(self, layer: int, topk_ids: torch.Tensor, n_rows: torch.Tensor) -> CacheCall:
        """The twin's `stream_lookup`: the hits' slots (`hit_slots`; -1 for every other pair), the
        replacement state and counters updated, nothing placed (a prefill streams the rest)."""
        call = self._call(layer, topk_ids, LOOKUP)
        launch(STREAM, self.policy_code, topk_ids, n_rows, layer, self, call, tile=self.slot_tile)
        return call

    def prefetch(
        self,
        layer: int,
        predicted_ids: torch.Tensor,
        n_rows: torch.Tensor,
        guard: CacheCall,
        evict_below: int = 0,
        host_costs: torch.Tensor | None = None,
    ) -> CacheCall:
        """Slots for the predicted experts of `layer` (its list and count in the result), evicting
        none of the slots in `guard` (the lookup of the layer computing meanwhile); with `host_costs`
        (the host's share of decode layers, host_compute/decode_share.py) none for the host's share of them."""
        call = self._call(layer, predicted_ids, PREFETCH)
        launch(
            PREFETCH,
            self.policy_code,
            predicted_ids,
            n_rows,
            layer,
            self,
            call,
            guard=(guard.hit_slots, guard.miss_slots),
            evict_below=evict_below,
            host_costs=host_costs,
            tile=self.slot_tile,
        )
        return call

    def _call(self, layer: int, ids: torch.Tensor, mode: int) -> CacheCall:
        pairs = ids.numel()
        if ids.dim() != 2 or not ids.is_contiguous() or pairs > self.max_pairs:
            raise ValueError(
                f"topk ids must be a contiguous [T, k] tensor of at most {self.max_pairs} pairs, got {tuple(ids.shape)}"
            )
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"MoE layer {layer} out of range [0, {self.num_layers})")
        lists = (
            (self.lookup_misses, self.lookup_count) if mode == LOOKUP else (self.prefetch_misses, self.prefetch_count)
        )
        return CacheCall(self.hit_slots[:pairs], self.miss_slots[:pairs], lists[0][layer], lists[1][layer : layer + 1])

    def counters_dict(self, counters: np.ndarray) -> dict[str, int]:
        names = {
            "lookups": LOOKUPS,
            "hits": HITS,
            "misses": MISSES,
            "evictions": EVICTIONS,
            "prefetched": PREFETCHED,
            "prefetch_useful": PREFETCH_USEFUL,
            "prefetch_wasted": PREFETCH_WASTED,
        }
        return {n: int(counters[i]) for n, i in names.items()}
