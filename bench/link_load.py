"""A full host-to-device link on a stream of its own, for benches that time something beside it (issue 25).

In a served decode step under the host's share, the next layer's prefetched experts cross PCIe while the
host computes this layer's share: the GPU unpacks pinned host banks at the link's rate, and the host
kernel reads the same DRAM. bench/host_handoff_latency.py times the hand-off's round trip beside this
load, bench/host_price_tokens.py the host kernel's experts.

Kinds: `packed` is what the served cuts run (12-bit banks, the default `--expert-bank-format`, copied by
the unpacking kernel: services/worker/offload/host_memory/packed_banks.py); `plain` the copy kernel over bf16 banks
(kernels/expert_copy.py, `--expert-bank-format plain`); `ce` the same bf16 bytes on the copy engine.
"""

from __future__ import annotations

import collections

import torch

KINDS = ("packed", "plain", "ce")
# loads kept queued: ~30-50 ms of traffic ahead, past the longest call timed beside it (256 tokens x 8 experts)
AHEAD = 8


class LinkLoad:
    """Host-to-device traffic on a stream of its own, topped up before each timed call (`keep_ahead`) so that
    PCIe stays busy through it: one load is `experts` 30B-sized experts of one layer (~5-6 ms at the link's
    rate), the `kind`'s copy of them into device slots. Between `begin` and `end_timed` lies a timed stretch;
    `gbps` then gives the rate the load kept over it."""

    def __init__(self, kind: str, device: torch.device, experts: int = 32, hidden: int = 2048, inter: int = 768):
        if kind not in KINDS:
            raise ValueError(f"a link load is one of {', '.join(KINDS)}, not {kind!r}")
        self.kind, self.stream = kind, torch.cuda.Stream(device)
        self.misses = torch.tensor([[e, e] for e in range(experts)], dtype=torch.int32, device=device)
        self.count = torch.tensor([experts], dtype=torch.int32, device=device)
        self.slots13 = torch.empty(experts, 2 * inter, hidden, dtype=torch.bfloat16, device=device)
        self.slots2 = torch.empty(experts, hidden, inter, dtype=torch.bfloat16, device=device)
        self.banks = self.bank13 = self.bank2 = None
        if kind == "packed":
            from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks

            self.banks = PackedHostBanks.allocate(1, experts, hidden, inter, pin=True, progress=False)
            self.banks.fill_dummy(progress=False)  # the served dummy experts' bits, escapes and all
            self.banks.seal()
            self.bytes_each = experts * self.banks.expert_nbytes  # what crosses: 12 bits a value and the escapes
        else:
            from ferry.services.worker.offload.host_memory.host_banks import pinnable_host_block

            # page-locked and mapped as the served banks are (the copy kernel reads them through that mapping)
            self.bank13 = pinnable_host_block((experts, 2 * inter, hidden), torch.bfloat16, pin=True).zero_()
            self.bank2 = pinnable_host_block((experts, hidden, inter), torch.bfloat16, pin=True).zero_()
            self.bytes_each = self.bank13.nbytes + self.bank2.nbytes
        with torch.cuda.stream(self.stream):
            self._copy()  # compiled (or its cache read) and first used here, outside any timed stretch
        self.stream.synchronize()
        self.begin()

    def _copy(self) -> None:
        if self.kind == "packed":
            self.banks.copy_listed(0, self.slots13, self.slots2, self.misses, self.count)
        elif self.kind == "plain":
            from ferry.kernels.expert_copy import copy_experts_triton

            copy_experts_triton(self.bank13, self.bank2, self.slots13, self.slots2, self.misses, self.count)
        else:
            self.slots13.copy_(self.bank13, non_blocking=True)
            self.slots2.copy_(self.bank2, non_blocking=True)

    def begin(self) -> None:
        """A new timed stretch: its clock starts at its first load."""
        self.start, self.until = None, None
        self.pending: collections.deque = collections.deque()  # loads not yet seen done
        self.ends: list[torch.cuda.Event] = []  # every load's end in this stretch

    def queue(self) -> None:
        """One more load behind what its stream has queued."""
        with torch.cuda.stream(self.stream):
            if self.start is None:
                self.start = torch.cuda.Event(enable_timing=True)
                self.start.record(self.stream)
            self._copy()
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.stream)
        self.pending.append(done)
        self.ends.append(done)

    def keep_ahead(self, loads: int = AHEAD) -> None:
        """Top the stream up to `loads` loads not yet done, so that a call timed next runs beside a full link
        from its start to its end (for calls shorter than those loads), without piling up more."""
        while self.pending and self.pending[0].query():
            self.pending.popleft()
        while len(self.pending) < loads:
            self.queue()

    def end_timed(self) -> None:
        """The timed stretch ends now: an event on the caller's stream, behind the timed work queued there."""
        self.until = torch.cuda.Event(enable_timing=True)
        self.until.record()

    def gbps(self) -> float | None:
        """The rate the load kept over the timed stretch: the loads that had finished by its end, over the time
        from the first load's start to the last of those loads' end. The loads still queued past the end
        drain first, beside nothing, and are not counted. None where no load finished inside the stretch."""
        if self.start is None or self.until is None:
            raise RuntimeError("gbps needs a stretch: begin, keep_ahead before each timed call, end_timed")
        self.stream.synchronize()
        self.until.synchronize()
        horizon = self.start.elapsed_time(self.until)
        inside = [t for t in (self.start.elapsed_time(e) for e in self.ends) if t <= horizon]
        if not inside:
            return None
        return len(inside) * self.bytes_each / (max(inside) * 1e-3) / 1e9

    def close(self) -> None:
        """Let the pinned banks go (after the stream has drained)."""
        from ferry.services.worker.offload.host_memory.host_banks import unregister_host_blocks

        self.stream.synchronize()
        if self.bank13 is not None:
            unregister_host_blocks([self.bank13, self.bank2])
        self.banks = self.bank13 = self.bank2 = None  # packed banks unregister as they are freed
