"""The staging slots through which a prefill streams its missed experts, past the cache (docs/ARCHITECTURE.md §3).

A prefill of more than a few dozen tokens routes to nearly every expert of every MoE layer. Put
through the cache, its misses evict what the layers after it are about to read (the cache holds
about slots/experts of each layer, a scan needs all of them), and the scan leaves the cache
holding its own last layers. So such a step places nothing (`DeviceDrivenExperts`,
`stream_lookup`): every expert of a layer that is not resident crosses PCIe once, into one of R
staging slots outside the cache (priced with the expert pool: pool_layout.prefill_staging_slots),
is computed there, and its slot goes to the next staged expert. A prefill copies exactly the
experts it lacks, and the cache keeps what the decode uses.

A prefill with a long context may lend the ring the cache's last slots for its step (`begin`'s
`lent`: the store evicted them first, stores/device_driven.py says when and how many): more bays, so the
copies run ahead through a full-attention layer, whose compute over a long context takes longer
than its experts' copies, instead of waiting at R experts ahead. After the step those slots are
the cache's again, free, and decode fills them first.

The ring is one FIFO over the whole step: the staged experts of every layer in layer order, cut
into chunks of up to C of one layer's experts; the R slots are R/C bays of C consecutive slots,
one chunk per bay (consecutive experts then cross in one copy, into consecutive slots). A
chunk's copies (on the copy stream: the copy engine, or the unpacking kernel for packed banks)
are enqueued as soon as a bay is free, and a bay is free once the computation of the chunk that
used it last is *enqueued*: the copy waits
for that computation on the device, by its event. So the copies run up to R experts ahead of
the computation, across layer boundaries, and the host never waits for the device during the
step. A chunk's computation waits for its copies by their event. On CPU everything runs in
order and no events are needed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

# The ring's copies run beside the step's compute on a stream of their own at the highest priority
# (stores/device_driven.py), so the block scheduler places them as compute blocks retire instead of after
# a whole attention kernel. For packed banks a copy is the unpacking kernel, on the GPU's own
# cores: 32 programs, which measured 49.8 GB/s against 64's 50.1 (kernels/expert_pack.py), leave
# the compute the other SMs.
RING_UNPACK_PROGRAMS = 32


@dataclass(frozen=True, eq=False)
class Bay:
    """C consecutive slots of one set of tensors: the staging slots' own, or the cache's lent for a step (the
    kernels read either through the slot pool's views, `ExpertSlotPool.layer_views`)."""

    first_slot: int
    w13: torch.Tensor
    w2: torch.Tensor
    lent: bool = False


@dataclass
class StagedChunk:
    """Experts of one MoE layer, and the slots of its bay they were copied into (once enqueued)."""

    layer: int
    first: int  # position of experts[0] in the layer's staged list
    experts: list[int]
    slots: list[int] = field(default_factory=list)  # consecutive: bay.first_slot + i
    bay: Bay | None = None
    landed: torch.cuda.Event | None = None  # the copies are done (CUDA)
    copy_events: tuple | None = None  # (start, end) timing events of the copies (CUDA)


class StagingRing:
    """R staging slots (`w13` [R, 2I, H], `w2` [R, H, I], or byte rows in a quantized format) filled
    from the host `banks` on `copy_stream` (None on CPU: synchronous copies), in chunks of at most
    `chunk` experts (R // chunk bays)."""

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        banks,
        copy_stream: torch.cuda.Stream | None,
        chunk: int | None = None,
        after: torch.cuda.Stream | None = None,
        long_chunk: int | None = None,
    ):
        """`long_chunk`: experts a chunk holds in a step that lends the ring cache slots (a long prefill
        far into its context: more bays, so fewer, larger chunks each pay the host's launches once);
        None: `chunk`, as every other step."""
        if w13.shape[0] != w2.shape[0] or w13.shape[0] < 1:
            raise ValueError(f"staging slots must be a non-empty [R, ...] pair, got {w13.shape[0]} and {w2.shape[0]}")
        self.w13, self.w2, self.banks, self.copy_stream = w13, w2, banks, copy_stream
        self.after = after  # the cache's own copy stream: a step's copies start behind what it enqueued
        self.size = w13.shape[0]
        # four bays: a chunk computes while the next ones cross
        self.chunk = chunk if chunk is not None else max(1, self.size // 4)
        if not 1 <= self.chunk <= self.size:
            raise ValueError(
                f"--prefill-ring-chunk {self.chunk}: a chunk must fit the {self.size} staging slots "
                "(and hold at least one expert)"
            )
        self.base_chunk = self.chunk  # the chunk of a step that lends nothing
        self.long_chunk = long_chunk if long_chunk is not None else self.chunk
        if not 1 <= self.long_chunk <= self.size:
            raise ValueError(
                f"--long-prefill-ring-chunk {self.long_chunk}: a chunk must fit the {self.size} "
                "staging slots (and hold at least one expert)"
            )
        self._bays: list[Bay] = []
        self._free: deque[tuple[Bay, torch.cuda.Event | None]] = deque()
        self._reset_bays()
        self._lent_bays = 0  # of the step begun last
        self.lent_total = 0  # cache slots lent since boot
        self._queued: deque[StagedChunk] = deque()  # not copied yet
        self._copied: deque[StagedChunk] = deque()  # copies enqueued, computation not yet
        self._taken: StagedChunk | None = None  # handed out, not yet released
        self.staged_total = 0  # experts staged since boot

    def use_chunks(self, base: int, long: int) -> None:
        """The chunk sizes of the steps begun from now on (`base_chunk`, `long_chunk`): the benches'
        --ring-chunks."""
        for c in (base, long):
            if not 1 <= c <= self.size:
                raise ValueError(f"a chunk of {c} experts does not fit {self.size} staging slots")
        self.base_chunk, self.long_chunk = base, long

    def _reset_bays(self) -> None:
        """Every staging bay free (its last reader's event, or None: nothing pending), C slots each."""
        self._bays = [Bay(b * self.chunk, self.w13, self.w2) for b in range(self.size // self.chunk)]
        self._free = deque((bay, None) for bay in self._bays)

    def begin(self, staged: list[list[int]], lent: tuple[int, int, tuple] | None = None) -> None:
        """A new step, which stages `staged[layer]` (ascending experts) for every MoE layer. `lent`
        (first slot, count, (w13, w2) of the cache): slots the step may use besides
        the staging slots, in bays of C; nothing may read or write them until the step's
        computations are done (the caller evicted them and synchronised). A step that lends cuts its
        chunks at `long_chunk`, any other at `base_chunk`."""
        pending = len(self._free) != len(self._bays) + self._lent_bays
        chunk = self.long_chunk if lent is not None else self.base_chunk
        resized, self.chunk = chunk != self.chunk, chunk
        if self._copied or self._taken is not None or pending or resized or len(self._bays) != self.size // self.chunk:
            # a step that stopped midway (or another chunk size, bench/profile_prefill.py): wait for
            # what it enqueued, once, rather than track it
            if self.copy_stream is not None:
                torch.cuda.current_stream().wait_stream(self.copy_stream)
                self.copy_stream.wait_stream(torch.cuda.current_stream())
            self._reset_bays()
        # the last step's lent bays are the cache's again: its computations were enqueued before
        # this step's synchronisation, and the cache's own copies wait for the lookups after them
        self._free = deque((bay, event) for bay, event in self._free if not bay.lent)
        self._lent_bays = 0
        if lent is not None:
            first, count, tensors = lent
            bays = [Bay(first + b * self.chunk, *tensors, lent=True) for b in range(count // self.chunk)]
            self._free.extendleft(reversed([(bay, None) for bay in bays]))
            self._lent_bays = len(bays)
            self.lent_total += len(bays) * self.chunk
        if self.copy_stream is not None and self.after is not None:
            self.copy_stream.wait_stream(self.after)
        self._copied.clear()
        self._taken = None
        self._queued.clear()
        for layer, experts in enumerate(staged):
            for i in range(0, len(experts), self.chunk):
                self._queued.append(StagedChunk(layer, i, list(experts[i : i + self.chunk])))
            self.staged_total += len(experts)
        self.fill()

    def take(self, layer: int) -> StagedChunk | None:
        """The next chunk of `layer` (its copies enqueued), or None when the layer has no more;
        `release` it before taking the next."""
        if self._taken is not None:
            raise RuntimeError("staging ring: release the chunk taken before taking the next")
        self.fill()
        head = self._copied[0] if self._copied else self._queued[0] if self._queued else None
        if head is None or head.layer > layer:
            return None
        if head.layer < layer:
            raise RuntimeError(f"staging ring: MoE layer {layer} computes before layer {head.layer}'s staged experts")
        if not self._copied:
            raise RuntimeError("staging ring: a chunk found no free slots although nothing is in flight")
        self._taken = self._copied.popleft()
        return self._taken

    def release(self, chunk: StagedChunk, computed: torch.cuda.Event | None) -> None:
        """`chunk`'s computation is enqueued (`computed` marks it done): its slots take the next copies."""
        if chunk is not self._taken:
            raise RuntimeError("staging ring: release the chunk that was taken")
        self._taken = None
        self._free.append((chunk.bay, computed))
        self.fill()

    def fill(self) -> None:
        """Enqueue the copies of every queued chunk that the free slots can take, in order."""
        while self._queued and self._free:
            chunk = self._queued.popleft()
            bay, last_reader = self._free.popleft()
            chunk.bay = bay
            chunk.slots = list(range(bay.first_slot, bay.first_slot + len(chunk.experts)))
            self._copy(chunk, last_reader)
            self._copied.append(chunk)

    def _copy(self, chunk: StagedChunk, last_reader: torch.cuda.Event | None) -> None:
        """The chunk's experts into its bay (plain banks: one copy per run of consecutive experts
        and weight family; packed: one unpacking launch)."""
        pairs = list(zip(chunk.experts, chunk.slots))
        w13, w2 = chunk.bay.w13, chunk.bay.w2
        if self.copy_stream is None:
            self.banks.copy_experts(chunk.layer, pairs, w13, w2)
            return
        with torch.cuda.stream(self.copy_stream):
            if last_reader is not None:
                self.copy_stream.wait_event(last_reader)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            self.banks.copy_experts(chunk.layer, pairs, w13, w2, non_blocking=True, programs=RING_UNPACK_PROGRAMS)
            end.record(self.copy_stream)
        chunk.landed, chunk.copy_events = end, (start, end)
