"""The offloading expert store driven from the device (docs/ARCHITECTURE.md §3): what `ferry serve` runs on CUDA.

Per MoE layer of a decode step (few (token, k) pairs), with no host round trip, so the whole
step can be replayed as a CUDA graph:

    lookup kernel ──▶ miss list ──▶ copy kernel (copy stream: host banks -> slots, GPU-driven)
         │                    └──▶ router of layer L+1 on this layer's input ─▶ prefetch kernel
         │                                                                  ─▶ copy kernel (copy stream)
         └──▶ hits' expert GEMV (compute stream; first waits for this layer's prefetched experts)
              ──▶ wait for the misses' copy ──▶ misses' expert GEMV ──▶ sum over k

* the cache's state and decisions are on the device (device_cache.py, kernels/expert_cache_lookup.py);
* misses cross PCIe through the banks' `copy_listed`: the copy kernel (kernels/expert_copy.py),
  or for packed banks the unpacking one (kernels/expert_pack.py), reads the miss list and its
  count on the device; the hits are computed meanwhile;
* next-layer prefetch: layer L+1's router applied to layer L's input predicts its experts; the
  missing ones get slots (never one layer L uses) and start crossing on the copy stream, behind
  layer L's own misses, while layer L computes. What the prediction missed is fetched by
  layer L+1's own lookup. `prefetch=False` turns it off. With the host's share of decode layers
  (host_compute/decode_share.py) the prefetch leaves the host's part of the predicted experts off the link: they
  reach layer L+1 as misses, and its hand-off, counting the prefetched ones as the link's load,
  gives them to the host. Both only in launches the share covers (`covers`: at least its min_tokens rows).

Larger steps (big decode batches, short prefills) take the same decisions on the device but read
the lists on the host and copy them with the banks' `copy_experts` (plain banks: the copy engine,
cudaMemcpyAsync, the higher bandwidth when many experts cross at once;
packed banks: the unpacking kernel), in chunks that are computed as they land; their
next layer is prefetched the same way. Steps that route to nearly every expert of every layer
(at least STREAM_PAIRS_PER_EXPERT (token, k) pairs per expert: a prefill) place nothing in the
cache: they stream every non-resident expert through the staging ring (staging_ring.py), so each
crosses once and the cache keeps what the decode uses. Each (token, k) pair is computed exactly once into a
row buffer summed over k (float32; in the dtype past ROWS_FLOAT32_MAX_TOKENS tokens, kernels/expert_rows_sum.py),
with the same kernels as the all-resident store: the result is
bit for bit what an all-resident store computes (not with a host share: the host's per-token sum joins each
token's first row, a float32 reassociation).

Statistics come from the cache's device counters and the copy stamps, copied to the host with
the step's results (`stats_to_host` before the step's one synchronisation, `end_step` after).
On CPU this store runs through the Triton interpreter (tests of the CUDA path); plain CPU runs
use `OffloadedExperts`, whose host policy is this store's reference twin.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import structlog
import torch
import torch.nn.functional as F

from ferry.kernels.align_pairs import align_pairs_by_slot
from ferry.kernels.aligned_blocks import SMALL_BLOCK_MAX_PAIRS, block_m_for
from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton, use_pair_kernel
from ferry.kernels.expert_rows_sum import ExpertRows, finish_rows, new_rows, rows_dtype, sum_rows
from ferry.kernels.grouped_expert_gemm import grouped_expert_rows_triton
from ferry.kernels.router_topk import router_topk
from ferry.plan.costs import ROWS_FLOAT32_MAX_TOKENS
from ferry.services.worker.offload.host_compute.decode_share import HostDecodeShare
from ferry.services.worker.offload.host_compute.prefill_share import HostShare
from ferry.services.worker.offload.host_memory.staging_ring import StagingRing
from ferry.services.worker.offload.slot_cache.device_cache import CacheCall, DeviceExpertCache
from ferry.services.worker.offload.stores.offloaded import DEFAULT_PIPELINE_CHUNKS, OffloadedExperts, _split

log = structlog.get_logger("worker.offload")

# copy_stamps columns (pool_layout.COPY_STAMPS)
MISS_START, MISS_END, PREFETCH_START, PREFETCH_END, BEFORE_PREFETCH_WAIT, HITS_DONE = range(6)
# A step with at least this many (token, k) pairs per expert routes to nearly every expert of a layer
# (1 - e^-4 = 98% of them with uniform routing): it streams the non-resident ones (staging_ring.py).
STREAM_PAIRS_PER_EXPERT = 4


class DeviceDrivenExperts(OffloadedExperts):
    """An `ExpertStore` whose cache lives on the device. Loading and warm-up are the host
    store's (`load_expert`, `preload`); the device state starts from the warmed-up twin."""

    def __init__(
        self,
        slots,
        banks,
        policy,
        device,
        prefetch: bool = True,
        pipeline_chunks: int = DEFAULT_PIPELINE_CHUNKS,
        copy_engine_tokens: int | None = None,
        host_share: HostShare | None = None,
        ring_chunks: tuple[int | None, int | None] = (None, None),
    ):
        """`copy_engine_tokens`: steps of at least this many tokens take the copy-engine path even
        when the graph-safe one could serve them (None: only steps too large for the pair kernel).
        `host_share`: the host computes part of a streamed step's missed experts (host_compute/prefill_share.py).
        `ring_chunks`: experts a ring chunk holds in a streamed step, and in a long-context prefill step,
        which lends the ring cache slots (--prefill-ring-chunk, --long-prefill-ring-chunk; None: the
        ring's own defaults, staging_ring.py)."""
        super().__init__(slots, banks, policy, device, pipeline_chunks=pipeline_chunks, use_triton=True)
        self.host_share = host_share
        # the host's share of decode layers' misses (expert_backends.py attaches it at boot)
        self.host_decode: HostDecodeShare | None = None
        self._host_experts: list[np.ndarray] = []  # per layer, the streamed step's experts the host computes
        self._host_table: torch.Tensor | None = None  # [layers, E + 1] bool on the device: the same
        self._stream_real = 0  # the streamed step's real rows
        self.prefetch_enabled = prefetch
        self.copy_engine_tokens = copy_engine_tokens
        self.routers: list[torch.Tensor] | None = None  # [E, H] router weight of every MoE layer
        self.router_biases: list[torch.Tensor | None] | None = None  # [E] their logit biases, where they have them
        self.cache: DeviceExpertCache | None = None
        self._prefetch_done: dict[int, torch.cuda.Event] = {}
        self._prefetch_calls: dict[int, CacheCall] = {}  # this step's prefetches, by the layer they fill
        self._predict_stream = torch.cuda.Stream(self.device) if self._cuda else None  # _prefetch_beside
        self._timing = self._cuda
        # (counters, stamps, ready event, copy events) queued by stats_to_host, one per step in flight,
        # oldest first: a step scheduled ahead is launched before the one before it is folded
        self._stats_queue: deque[tuple] = deque()
        self._spare_stats: list[tuple[torch.Tensor, torch.Tensor]] = []  # host buffers end_step has read
        self._last_counters: dict[str, int] | None = None
        self._step_copy_events: list = []
        self.ring = None
        # MoE layers from one full-attention layer to the next (build_offloaded_experts sets it from the
        # model: 4 on the hybrids, 1 where every layer attends): what a long prefill lends its ring for
        self.attention_period = 1
        self.lent_evictions = 0  # experts evicted to lend their slots to a long prefill's ring, since boot
        self._stream_begun = False  # begin_step started this step's stream (a prefill) before layer 0
        # the kinds of rows (each view's ggml type: one kind unless they differ by layer) whose streamed kernels
        # _compile_stream_kernels compiled (boot's warm-up)
        self._stream_kernels_compiled: set[tuple] = set()
        self._said_no_lending = False  # the log line of a long chunk too large to lend any slot, once
        if slots.staging_w13 is not None:
            # the ring's own stream, at the highest priority (staging_ring.RING_UNPACK_PROGRAMS says why)
            ring_stream = torch.cuda.Stream(self.device, priority=-100) if self._cuda else None
            self.ring = StagingRing(
                slots.staging_w13,
                slots.staging_w2,
                banks,
                ring_stream,
                after=self._copy_stream if self._cuda else None,
                chunk=ring_chunks[0],
                long_chunk=ring_chunks[1],
            )

    def set_routers(self, routers: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> None:
        """The router weights of the MoE layers, in order, and their logit biases where the routers have them
        (gpt-oss): what the next-layer prediction applies."""
        if len(routers) != self.policy.num_layers or (biases is not None and len(biases) != len(routers)):
            raise ValueError(f"{len(routers)} routers for {self.policy.num_layers} MoE layers")
        self.routers = routers
        self.router_biases = biases

    def preload(self) -> int:
        placed = super().preload()
        self.cache = DeviceExpertCache(self.slots, self.policy)  # from here on the device decides
        self._last_counters = self._warm_counters = self.cache.counters_dict(self.cache.counters.cpu().numpy())
        return placed

    # ---- the step ------------------------------------------------------------------------------
    def begin_step(self, num_tokens: int, top_k: int, long_context: bool = False) -> None:
        """A step that will stream (a prefill) starts its copies now: which experts to stage is
        known from the maps alone, so they cross while the first layer's attention computes. A
        `long_context` step (a long prefill chunk far into its prompt) lends the ring cache slots."""
        self._stream_begun = False
        if self.cache is not None and self._streams(num_tokens * top_k):
            self._begin_stream(num_tokens, top_k, self._slots_to_lend() if long_context else 0)
            self._stream_begun = True

    def _slots_to_lend(self) -> int:
        """How many of the cache's slots a long-context prefill step lends its ring: enough for the
        experts the layers from one full-attention layer to the next stream (`attention_period`
        MoE layers' worth of the experts a layer lacks), so that the copies keep running through
        an attention layer's long compute; at most every slot. It costs those slots' contents:
        decode fills them again, free slots first, within a few tokens of misses, and the
        step itself streams them too (each lent slot is one more expert copied)."""
        slots = self.cache.num_slots
        missing_per_layer = self.num_experts - slots / self.policy.num_layers
        wanted = int(self.attention_period * missing_per_layer)
        lent = min(slots, wanted) // self.ring.long_chunk * self.ring.long_chunk  # whole bays of a lending step
        if not lent and min(slots, wanted) and not self._said_no_lending:
            self._said_no_lending = True
            log.warning(
                "long_prefill_lends_nothing",
                lendable_slots=min(slots, wanted),
                long_chunk=self.ring.long_chunk,
                reason="--long-prefill-ring-chunk is larger than the cache slots a long prefill step may lend: "
                "such steps lend none and use the ring's own chunk",
            )
        return lent

    def _streams(self, pairs: int) -> bool:
        """Whether a step of `pairs` (token, k) pairs streams past the cache (see STREAM_PAIRS_PER_EXPERT)."""
        return (
            self.ring is not None and not use_pair_kernel(pairs) and pairs >= STREAM_PAIRS_PER_EXPERT * self.num_experts
        )

    def forward(
        self,
        moe_layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        n_rows: torch.Tensor | None = None,
        summed: bool = True,
    ) -> torch.Tensor | ExpertRows:
        if self.cache is None:
            self.preload()
        begun = False
        if moe_layer == 0:
            self._prefetch_done.clear()  # a new step (every entry is consumed within a step)
            self._prefetch_calls.clear()
            begun, self._stream_begun = self._stream_begun, False
        t, k = topk_ids.shape
        if n_rows is None:
            n_rows = torch.full((1,), t, dtype=torch.int32, device=x.device)
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        rows = new_rows(x, k)  # float32, or the dtype past ROWS_FLOAT32_MAX_TOKENS (kernels/expert_rows_sum.py)
        if use_pair_kernel(t * k) and (self.copy_engine_tokens is None or t < self.copy_engine_tokens):
            self._decode_layer(moe_layer, x, ids, topk_weights, n_rows, rows)
        elif self._streams(t * k):
            if moe_layer == 0 and not begun:  # the maps as the step starts: nothing changes them until it ends
                self._begin_stream(int(n_rows[0]), k)  # one wait: the maps are then read from an idle stream
            self._streamed_layer(moe_layer, x, ids, topk_weights, n_rows, rows)
        else:
            self._large_layer(moe_layer, x, ids, topk_weights, n_rows, rows)
        return finish_rows(rows, x.dtype, summed)

    def _decode_layer(self, layer, x, ids, weights, n_rows, rows) -> None:
        """Graph-safe: no host synchronisation, fixed addresses, fixed launch shapes."""
        t, k = ids.shape
        call = self.cache.lookup(layer, ids, n_rows)
        # the host's share of the misses (host_compute/decode_share.py): decided before the copy kernel reads the count,
        # knowing what this layer's prefetch has put on the link already
        handed = None
        if self.host_decode is not None and self.host_decode.covers(t):
            prefetched = self._prefetch_calls.get(layer)
            in_flight = prefetched.count if prefetched is not None else None
            handed = self.host_decode.start(layer, x, ids, weights, n_rows, call, self.cache, in_flight)
        stamps = self.cache.copy_stamps[layer]
        copied = self._on_copy_stream(lambda: self._copy_sm(layer, call), stamps, MISS_START, MISS_END)
        predicted = self._prefetch_beside(layer, x, n_rows, call)
        self._wait_prefetched(layer, stamps)
        gemm13, gemm2 = self.slots.layer_views(layer)
        expert_pair_rows_triton(x, call.hit_slots.view(t, k), weights, gemm13, gemm2, rows)
        self._stamp(stamps, HITS_DONE)
        if copied is not None:
            torch.cuda.current_stream(self.device).wait_event(copied)
        expert_pair_rows_triton(x, call.miss_slots.view(t, k), weights, gemm13, gemm2, rows)
        if predicted is not None:  # the next layer's lookup shares the cache's state and scratch with the prefetch
            torch.cuda.current_stream(self.device).wait_event(predicted)
        if handed is not None:
            self.host_decode.finish(handed, rows)

    def _large_layer(self, layer, x, ids, weights, n_rows, rows) -> None:
        """Prefill and large batches: the decisions on the device, the lists read on the host, the
        copy engine moving them in chunks, each chunk's pairs computed once it has landed."""
        t, k = ids.shape
        # a prefill passes through (nearly) every expert of every layer once: evict the passed
        # layers' experts first, not those the layers ahead are about to read
        scan_below = 0 if use_pair_kernel(t * k) else layer
        call = self.cache.lookup(layer, ids, n_rows, evict_below=scan_below)
        misses = self._read_list(call)
        chunks = _split(misses, self.pipeline_chunks)
        landed = [self._on_copy_stream(lambda c=c: self._copy_ce(layer, c), None, 0, 0, timed=True) for c in chunks]
        self._prefetch_next(layer, x, n_rows, call, large=True, evict_below=scan_below)
        self._wait_prefetched(layer, None)
        self._compute(layer, x, call.hit_slots.view(t, k), weights, rows)
        miss_slots = call.miss_slots.view(t, k)
        start = 0
        for chunk, done in zip(chunks, landed):
            if done is not None:
                self._stall(done)
            mine = call.misses[start : start + len(chunk), 1]  # this chunk's slots, already on the device
            start += len(chunk)
            self._compute(layer, x, torch.where(torch.isin(miss_slots, mine), miss_slots, -1), weights, rows)

    def _streamed_layer(self, layer, x, ids, weights, n_rows, rows) -> None:
        """A prefill: the hits from their slots, every other expert of the layer through the
        staging ring (copied ahead since the step began, computed chunk by chunk as it lands);
        the cache places nothing. No host synchronisation but one per step, as it begins.

        The streamed pairs are grouped once per layer, by their expert's position in the layer's
        staged list; a chunk computes the blocks of its positions, pointed at its bay."""
        t, k = ids.shape
        call = self.cache.stream_lookup(layer, ids, n_rows)
        # padding rows (past n_rows) look up the sentinel entry E: neither staged nor the host's
        padding = torch.arange(t, device=x.device).unsqueeze(1) >= n_rows.to(x.device)
        host = None
        if self.host_share is not None and len(self._host_experts[layer]):
            host = self.host_share.start(layer, x, ids, weights, self._stream_real, self._host_experts[layer])
        # float32 once for the layer: the expert kernels' wrapper converts its weights every call, and a
        # layer streams in dozens of calls (one a ring chunk); the same values, converted once
        weights32 = weights.float()
        self._compute(layer, x, call.hit_slots.view(t, k), weights32, rows)
        self._stream_staged(layer, x, ids, weights32, rows, padding)
        if host is not None:
            self.host_share.finish(host, rows, self._host_table[layer][torch.where(padding, self.num_experts, ids)])

    def _stream_staged(self, layer, x, ids, weights, rows, padding) -> None:
        """The layer's staged experts, chunk by chunk as they land in the ring."""
        t, k = ids.shape
        staged = self._staged_count[layer]
        if not staged:
            if not self._stream_real:  # boot's warm-up (padding rows only): compile what a chunk launches
                self._compile_stream_kernels(layer, x, k)
            return
        position = self._staged_position[layer][torch.where(padding, self.num_experts, ids)]
        # with each position's first block: a chunk's launches cover its own blocks, not the layer's
        aligned = align_pairs_by_slot(position, staged, block_m_for(t * k), staged, block_starts=True)
        while (chunk := self.ring.take(layer)) is not None:
            if self._cuda:
                torch.cuda.current_stream(self.device).wait_event(chunk.landed)
                self._step_copy_events.append(chunk.copy_events)
            lo, hi = chunk.first, chunk.first + len(chunk.experts)
            gemm13, gemm2 = self.slots.layer_views(layer, staging=not chunk.bay.lent)  # the bay's own, or the cache's
            grouped_expert_rows_triton(
                x,
                None,
                weights,
                gemm13,
                gemm2,
                rows,
                aligned=aligned,
                slot_window=(lo, hi, chunk.slots[0] - lo),
            )
            computed = None
            if self._cuda:
                computed = torch.cuda.Event()
                computed.record(torch.cuda.current_stream(self.device))
            self.ring.release(chunk, computed)

    def _compile_stream_kernels(self, layer: int, x: torch.Tensor, top_k: int) -> None:
        """Once for each kind of rows (once, or per MoE layer's types where they differ by layer), from boot's
        warm-up (its streamed steps stage nothing, so no chunk would launch, and the first
        prefill after ready would compile what a chunk launches, warmup.py): the chunks' windowed kernels
        over an empty window of the ring's bays, and the layer's grouped kernel for its hits with every pair
        skipped, at each block size a streamed step can take (the small one where a step of at most
        SMALL_BLOCK_MAX_PAIRS pairs streams, the large one where a larger step fits), whatever sizes the
        warm-up's own steps have; and where a step can be longer than ROWS_FLOAT32_MAX_TOKENS, at its block size
        into rows in the model's dtype too, with the row sum over them (kernels/expert_rows_sum.py: a kernel a
        row dtype). Nothing is computed."""
        ring_views = self.slots.layer_views(layer, staging=True)
        kinds = tuple(getattr(view, "ggml_type", None) for view in ring_views)
        if kinds in self._stream_kernels_compiled:
            return
        self._stream_kernels_compiled.add(kinds)
        small = SMALL_BLOCK_MAX_PAIRS // top_k  # the most tokens of a small-block step
        sizes = [
            n
            for n, streams in (
                (small, self._streams(small * top_k)),
                (small + 1, self.cache.max_pairs > SMALL_BLOCK_MAX_PAIRS and self._streams(self.cache.max_pairs)),
            )
            if streams
        ]
        # the longest step's rows: where they are not float32 (a step past ROWS_FLOAT32_MAX_TOKENS fits), the
        # kernels of a step that long, at its block size, into rows of that dtype too
        long_rows = rows_dtype(self.cache.max_pairs // top_k, x.dtype)
        long_block = block_m_for((ROWS_FLOAT32_MAX_TOKENS + 1) * top_k)
        variants = [(n, torch.float32) for n in sizes]
        variants += [
            (n, long_rows) for n in sizes if long_rows != torch.float32 and block_m_for(n * top_k) == long_block
        ]
        for n, row_dtype in variants:
            xs = torch.zeros(n, x.shape[1], dtype=x.dtype, device=x.device)
            weights = torch.zeros(n, top_k, dtype=torch.float32, device=x.device)
            rows = torch.zeros(n, top_k, x.shape[1], dtype=row_dtype, device=x.device)
            nothing = torch.full((n, top_k), -1, dtype=torch.int32, device=x.device)
            aligned = align_pairs_by_slot(nothing, 1, block_m_for(n * top_k), 1, block_starts=True)
            grouped_expert_rows_triton(xs, None, weights, *ring_views, rows, aligned=aligned, slot_window=(0, 0, 0))
            self._compute(layer, xs, nothing, weights, rows)
            sum_rows(rows, x.dtype)  # the row sum over rows of this dtype too

    def _begin_stream(self, real: int, top_k: int, lend: int = 0) -> None:
        """Stage every non-resident expert of every layer (none for a step of `real` 0 rows: padding
        only, boot's warm-up) but the host's share of them (host_compute/prefill_share.py), and put each one's position
        in its layer's list on the device (-1: not staged). Called by `begin_step`, or at layer 0 when
        the step did not begin through it. `lend`: the cache's last slots the ring may use this step,
        evicted first (their experts are then staged like any other missing one)."""
        lent = self._evict_for_ring(lend) if lend and real else None
        resident = (self.cache.slot_of >= 0).cpu().numpy()
        missed = [np.flatnonzero(~r).tolist() if real else [] for r in resident]
        self._stream_real = real
        if self.host_share is not None:
            splits = [self.host_share.split(m, real, top_k, self.num_experts) for m in missed]
            staged = [gpu for gpu, _ in splits]
            self._host_experts = [np.asarray(host, dtype=np.int64) for _, host in splits]
            table = np.zeros((len(missed), self.num_experts + 1), dtype=bool)
            for layer, host in enumerate(self._host_experts):
                table[layer, host] = True
            table = torch.from_numpy(table)
            self._host_table = table.pin_memory().to(self.device, non_blocking=True) if self._cuda else table
        else:
            staged = missed
        position = np.full((len(staged), self.num_experts + 1), -1, dtype=np.int32)
        for layer, experts in enumerate(staged):
            position[layer, experts] = np.arange(len(experts), dtype=np.int32)
        table = torch.from_numpy(position)
        self._staged_position = table.pin_memory().to(self.device, non_blocking=True) if self._cuda else table
        self._staged_count = [len(e) for e in staged]
        self.ring.begin(staged, lent)

    def _evict_for_ring(self, count: int) -> tuple[int, int, tuple]:
        """Empty the cache's last `count` slots on the device, in stream order behind every step
        before (the caller's read of the slot map then synchronises): (first slot, count, the slot
        tensors) for the ring. A free slot is what the lookups place into first, so decode takes them
        back as it misses."""
        c = self.cache
        lent = slice(c.num_slots - count, c.num_slots)
        layers, experts = c.layer_of_slot[lent].long(), c.expert_of_slot[lent].long()
        held = layers >= 0
        c.slot_of.view(-1)[(layers * c.num_experts + experts)[held]] = -1
        self.lent_evictions += int(held.sum())  # a sync, as the caller's read of the map is
        c.layer_of_slot[lent] = -1
        c.expert_of_slot[lent] = -1
        c.prefetched[lent] = 0
        return c.num_slots - count, count, (self.slots.w13, self.slots.w2)

    def _compute(self, layer, x, group_slots, weights, rows) -> None:
        """One group of MoE layer `layer`'s pairs (slot -1 elsewhere): pair by pair for small steps, as the
        all-resident store computes them (same bits), else the grouped GEMM aligned on the device."""
        gemm13, gemm2 = self.slots.layer_views(layer)
        if use_pair_kernel(group_slots.numel()):
            expert_pair_rows_triton(x, group_slots, weights, gemm13, gemm2, rows)
        else:
            grouped_expert_rows_triton(
                x, group_slots, weights, gemm13, gemm2, rows, max_distinct_slots=self.num_experts
            )

    # ---- prefetch ----------------------------------------------------------------------------
    def _prefetch_next(
        self, layer: int, x: torch.Tensor, n_rows: torch.Tensor, call: CacheCall, large: bool, evict_below: int = 0
    ) -> None:
        nxt = layer + 1
        if not self.prefetch_enabled or self.routers is None or nxt >= self.policy.num_layers:
            return
        # the router's own top-k kernel: torch.topk's sort took ~4x its time a decode layer
        logits = F.linear(x, self.routers[nxt], self.router_biases[nxt] if self.router_biases is not None else None)
        predicted = router_topk(logits, call.hit_slots.numel() // x.shape[0], True, self.num_experts)[0]
        # a decode layer's host share: the host's part of the predicted experts stays off the link
        share = self.host_decode
        host_costs = share.costs if share is not None and not large and share.covers(x.shape[0]) else None
        pcall = self.cache.prefetch(
            nxt, predicted.contiguous(), n_rows, call, evict_below=evict_below, host_costs=host_costs
        )
        self._prefetch_calls[nxt] = pcall
        stamps = self.cache.copy_stamps[layer]
        if large:
            placed = self._read_list(pcall)
            done = self._on_copy_stream(lambda: self._copy_ce(nxt, placed), None, 0, 0, timed=True)
        else:
            done = self._on_copy_stream(lambda: self._copy_sm(nxt, pcall), stamps, PREFETCH_START, PREFETCH_END)
        if done is not None:
            self._prefetch_done[nxt] = done

    def _prefetch_beside(self, layer: int, x: torch.Tensor, n_rows: torch.Tensor, call: CacheCall):
        """The next layer's prefetch (prediction, lookup, copy queued) on a stream of its own, beside this
        layer's expert GEMVs: on the compute stream it held them back a router GEMM, a top-k and a lookup.
        It starts after this layer's lookup and hand-off (the cache's state is theirs until then), places
        no slot this layer uses (the guard), and returns the event the compute stream waits for before
        anything else touches the cache or frees `x` (None on CPU, where it ran in line)."""
        if not self._cuda:
            self._prefetch_next(layer, x, n_rows, call, large=False)
            return None
        looked_up = torch.cuda.Event()
        looked_up.record(torch.cuda.current_stream(self.device))
        self._predict_stream.wait_event(looked_up)
        with torch.cuda.stream(self._predict_stream):
            self._prefetch_next(layer, x, n_rows, call, large=False)
        predicted = torch.cuda.Event()
        predicted.record(self._predict_stream)
        return predicted

    def _wait_prefetched(self, layer: int, stamps: torch.Tensor | None) -> None:
        done = self._prefetch_done.pop(layer, None)
        if done is None:
            return
        if stamps is not None:
            self._stamp(stamps, BEFORE_PREFETCH_WAIT)
            torch.cuda.current_stream(self.device).wait_event(done)
        else:
            self._stall(done)

    # ---- copies --------------------------------------------------------------------------------
    def _copy_sm(self, layer: int, call: CacheCall) -> None:
        """The device-held list, copied by the GPU's cores (plain banks) or unpacked (packed banks)."""
        self.banks.copy_listed(layer, self.slots.w13, self.slots.w2, call.misses, call.count)

    def _copy_ce(self, layer: int, pairs: list[tuple[int, int]]) -> None:
        """A list read on the host: the copy engine (plain banks), or the unpacking kernel (packed)."""
        self.banks.copy_experts(layer, pairs, self.slots.w13, self.slots.w2, non_blocking=self._cuda)

    def _on_copy_stream(self, work, stamps, first: int, last: int, timed: bool = False):
        """Run `work` on the copy stream after everything queued so far on the compute stream;
        returns the event that marks it done (None on CPU, where it ran synchronously)."""
        if not self._cuda:
            work()
            return None
        compute, copy = torch.cuda.current_stream(self.device), self._copy_stream
        queued = torch.cuda.Event()
        queued.record(compute)
        copy.wait_event(queued)
        with torch.cuda.stream(copy):
            if timed:  # eager steps: timing events
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(copy)
                work()
                end.record(copy)
                self._step_copy_events.append((start, end))
            else:
                self._stamp(stamps, first)
                work()
                self._stamp(stamps, last)
        done = torch.cuda.Event()
        done.record(copy)
        return done

    def _stall(self, done: torch.cuda.Event) -> None:
        """The compute stream waits for a copy (eager steps), timed as exposed copy time."""
        compute = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        compute.wait_event(done)
        end.record(compute)
        self.stats.record_stall_events(start, end)

    def _stamp(self, stamps: torch.Tensor | None, column: int) -> None:
        if self._timing and stamps is not None:
            from ferry.kernels.device_clock import stamp

            stamp(stamps, column)

    def _read_list(self, call: CacheCall) -> list[tuple[int, int]]:
        """The (expert, slot) list on the host: one synchronisation (large steps only)."""
        count = int(call.count[0])
        return [tuple(r) for r in call.misses[:count].tolist()]

    # ---- statistics ------------------------------------------------------------------------------
    def count_step_on_device(self) -> None:
        """Nothing before the copy: the lookups count into the counters as they run."""

    def stats_to_host(self, counted: bool = False) -> None:
        """Queue the copy of the step's counters and stamps to the host (before the step's sync)."""
        if self.cache is None:
            return
        if self._spare_stats:  # pinned buffers are reused, not allocated each step
            counters, stamps, handed = self._spare_stats.pop()
        else:
            counters = torch.empty(self.cache.counters.shape, dtype=torch.int64, pin_memory=self._cuda)
            stamps = torch.empty(self.cache.copy_stamps.shape, dtype=torch.int64, pin_memory=self._cuda)
            handed = torch.zeros(2, dtype=torch.int64, pin_memory=self._cuda)  # host_decode's totals
        counters.copy_(self.cache.counters, non_blocking=self._cuda)
        stamps.copy_(self.cache.copy_stamps, non_blocking=self._cuda)
        if self.host_decode is not None:
            handed.copy_(self.host_decode.dev.totals, non_blocking=self._cuda)
        self.cache.copy_stamps.zero_()  # in stream order: the next step stamps afresh
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self._stats_queue.append((counters, stamps, handed, ready, self._step_copy_events))
        self._step_copy_events = []

    def end_step(self, synced: bool = False, decode_tokens: int | None = None) -> None:
        """Fold the step into the statistics; `synced`: the caller already waited for everything
        queued (the executor's one wait per step covers the copies `stats_to_host` queued);
        `decode_tokens` (ExpertStore.end_step) goes to auto's guard over the host's decode share."""
        if self.cache is None:
            return
        if not self._stats_queue:
            self.stats_to_host()
            synced = False
        counters, stamps, handed, ready, copy_events = self._stats_queue.popleft()
        if ready is not None and not synced:
            ready.synchronize()
        if self.host_decode is not None:
            self.host_decode.count(handed)
            self.host_decode.check()  # a host node cannot raise where it runs: its error surfaces here
            self.host_decode.refine()  # the split's price of a host expert, against what the nodes took
            self.host_decode.observe_step(time.monotonic(), decode_tokens)  # auto's guard (share_guard.py)
        now = self.cache.counters_dict(counters.numpy())
        now["host_decode"] = int(handed[0])  # misses the host computed: they never crossed
        before = self._last_counters
        delta = {n: now[n] - before.get(n, 0) for n in now}
        self._last_counters = now
        copies = delta["misses"] - delta["host_decode"] + delta["prefetched"]
        if delta["lookups"]:
            self.stats.record_lookup(delta["hits"], delta["misses"], copies * self.banks.expert_nbytes)
            self.stats.record_prefetch(delta["prefetched"], delta["prefetch_useful"], delta["prefetch_wasted"])
            copy_s, exposed_s = self._stamped_seconds(stamps)
            for start, end in copy_events:
                self.stats.record_copy_events(start, end)
            self.stats.record_copy_seconds(copy_s, exposed_s)
        self._spare_stats.append((counters, stamps, handed))  # read: the next step's copy may take them
        self.stats.end_step()
        self._last_layer = -1

    def _stamped_seconds(self, stamps: torch.Tensor) -> tuple[float, float]:
        """(copy time, exposed copy time) of the graph-safe layers, from one step's copy of the device
        stamps; the device rows are zeroed once copied, so a layer that ran no decode path adds nothing."""
        if not self._timing:
            return 0.0, 0.0
        s = stamps.numpy().astype(np.int64)
        ran = s[:, MISS_END] > 0
        copy = np.where(ran, s[:, MISS_END] - s[:, MISS_START], 0)
        pref = s[:, PREFETCH_END] > 0
        copy += np.where(pref, s[:, PREFETCH_END] - s[:, PREFETCH_START], 0)
        exposed = np.where(ran & (s[:, HITS_DONE] > 0), np.maximum(0, s[:, MISS_END] - s[:, HITS_DONE]), 0)
        # the wait for this layer's prefetched experts: stamped in the previous layer's row
        waited = np.zeros(len(s), dtype=np.int64)
        waited[1:] = np.where(
            pref[:-1] & (s[1:, BEFORE_PREFETCH_WAIT] > 0),
            np.maximum(0, s[:-1, PREFETCH_END] - s[1:, BEFORE_PREFETCH_WAIT]),
            0,
        )
        return float(copy.sum()) / 1e9, float((exposed + waited).sum()) / 1e9

    def report(self) -> dict:
        """The host store's report, with what the device decided since: evictions, and how many
        slots are filled (a placement takes a free slot while there is one, and slots never empty)."""
        out = {**super().report(), "prefetch": self.prefetch_enabled}
        if self.host_share is not None:  # streamed layers that took a host share, and the experts it computed
            c = self.host_share.cost
            out["host_share"] = {
                "layers": self.host_share.layers,
                "experts": self.host_share.computed,
                "costs_ns": [round(v * 1e9) for v in (c.pcie_s, c.host_s_at_1, c.host_s_per_token, c.overhead_s)],
            }
        if self.host_decode is not None:  # decode misses the host computed, and their pairs
            out["host_decode"] = self.host_decode.report()
        if self.cache is not None:
            c, start = self._last_counters, self._warm_counters
            placements = c["misses"] + c["prefetched"] - start["misses"] - start["prefetched"]
            placements -= self.ring.staged_total if self.ring is not None else 0  # staged (since boot), never placed
            placements -= c.get("host_decode", 0)  # handed to the host: their slots were freed
            resident = self.policy.resident + placements - self.lent_evictions
            if c.get("host_decode", 0):  # a handed miss may have evicted a victim for a slot it then left empty
                resident -= c["evictions"] - start["evictions"]
            out.update(
                evictions=c["evictions"] + self.lent_evictions,
                resident=min(self.policy.num_slots, resident),
                prefill_lent_slots=self.ring.lent_total if self.ring is not None else 0,
                prefill_lent_evictions=self.lent_evictions,
            )
        return out
