"""A full host-to-device link on a stream of its own, for benches that time something beside it (issue 25).

In a served decode step under the host's share, the next layer's prefetched experts cross PCIe while the
host computes this layer's share: the GPU's copy kernel reads pinned host memory at the link's rate, and
the host kernel reads the same DRAM. bench/host_handoff_latency.py times the hand-off's round trip beside
this load, bench/host_price_tokens.py the host kernel's experts.
"""

from __future__ import annotations

import collections

import torch

KINDS = ("sm", "ce")  # the decode step's copy kernel (the GPU's cores), or the copy engine
AHEAD = 8  # loads kept queued: ~48 ms of traffic ahead, past the longest call timed beside it (256 tokens x 8 experts)


class LinkLoad:
    """Host-to-device traffic on a stream of its own, topped up before each timed call (`keep_ahead`) so that
    PCIe stays busy through it: `kind` sm (the decode step's copy kernel over `experts` pinned 30B-sized
    experts) or ce (the same bytes copied by the copy engine). A load is 302 MB, ~6 ms at 50 GB/s; `gbps`
    drains the stream and gives the rate the load kept over the stretch."""

    def __init__(self, kind: str, device: torch.device, experts: int = 32, hidden: int = 2048, inter: int = 768):
        from ferry.services.worker.offload.host_banks import pinnable_host_block

        self.kind, self.stream = kind, torch.cuda.Stream(device)
        # page-locked and mapped as the served banks are (the copy kernel reads them through that mapping)
        self.bank13 = pinnable_host_block((experts, 2 * inter, hidden), torch.bfloat16, pin=True).zero_()
        self.bank2 = pinnable_host_block((experts, hidden, inter), torch.bfloat16, pin=True).zero_()
        self.slots13 = torch.empty_like(self.bank13, device=device)
        self.slots2 = torch.empty_like(self.bank2, device=device)
        self.misses = torch.tensor([[e, e] for e in range(experts)], dtype=torch.int32, device=device)
        self.count = torch.tensor([experts], dtype=torch.int32, device=device)
        self.bytes_each = self.bank13.nbytes + self.bank2.nbytes
        self.queued, self.start, self.pending = 0, None, collections.deque()

    def begin(self) -> None:
        """A new timed stretch: the clock starts at its first load."""
        self.queued, self.start, self.pending = 0, None, collections.deque()

    def queue(self) -> None:
        """One more load behind what its stream has queued (the stretch's first one starts the clock)."""
        from ferry.kernels.expert_copy import copy_experts_triton

        with torch.cuda.stream(self.stream):
            if self.start is None:
                self.start = torch.cuda.Event(enable_timing=True)
                self.start.record(self.stream)
            if self.kind == "sm":
                copy_experts_triton(self.bank13, self.bank2, self.slots13, self.slots2, self.misses, self.count)
            else:
                self.slots13.copy_(self.bank13, non_blocking=True)
                self.slots2.copy_(self.bank2, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.pending.append(done)
        self.queued += 1

    def keep_ahead(self, loads: int = AHEAD) -> None:
        """Top the stream up to `loads` loads not yet done: ~6 ms each, so a call of up to that many times
        6 ms runs beside a full link from its start to its end, and shorter calls do not pile up more."""
        while self.pending and self.pending[0].query():
            self.pending.popleft()
        while len(self.pending) < loads:
            self.queue()

    def gbps(self) -> float:
        """The load's own rate over the stretch (waits for its stream to drain): the link's share it kept."""
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        end.synchronize()
        return self.queued * self.bytes_each / (self.start.elapsed_time(end) * 1e-3) / 1e9

    def close(self) -> None:
        from ferry.services.worker.offload.host_banks import unregister_host_blocks

        self.stream.synchronize()
        unregister_host_blocks([self.bank13, self.bank2])
