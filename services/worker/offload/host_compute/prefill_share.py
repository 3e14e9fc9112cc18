"""The host's share of a streamed prefill's missed experts.

A prefill streams every expert a layer lacks through the staging ring (staging_ring.py): one pass over
the missed experts a step, over PCIe. A step of a few hundred tokens (the next turn of a conversation
whose prefix is cached, the own parts of requests sharing a system prompt) pays that whole pass for few
tokens an expert, and there the host can compute some of those experts where they lie, from the same
banks, while the others cross: HostExperts (host_experts.py) reads a bf16 or packed bank at 62 and 48
GB/s on a server host with 15 threads, against the link's 55.

The split is decided when the step begins, from the maps alone, as the ring's staging is: of a layer's
N missed experts the host takes the last h, so that both sides end together,

    (N - h) x pcie_s  =  overhead_s + h x host_s(n),    n = the step's (token, k) pairs / experts,

where `pcie_s` is one expert's copy, `host_s(n)` one expert's computation for n tokens (a + b n: memory
bound at few tokens, compute bound at many, so a long prefill's share falls to nothing), and `overhead_s`
the hand-off (the layer's input to the host, the result back). `HostCost` holds those measured figures,
and the range they were measured over: a step of more tokens, or of more tokens an expert, gives the host
nothing. Outside it the model is wrong by far: with a few host
experts a layer priced to save 3 %, 8,192-token chunks of the hybrid cut took 0.49-0.62 s against 0.18-0.19
GPU-only, and 1,200-token steps 0.26-0.29 against 0.20-0.23 (the hand-off's copies grow with the step's
tokens, its price was timed at 512; the kernel's time at 37-256 tokens an expert was extrapolated from 16).

Per layer (`HostShare.start`, then `finish`): the layer's input x, its routing and its real row count
are copied into pinned buffers behind the router's kernels, with an event; a host thread waits for that
event, computes the pairs routed to its experts (HostExperts: the router weight applied, summed per token)
and returns float32 [T, H]. Meanwhile the device computes the hits and the staged experts. Before the
layer's rows are summed, the host pairs' rows (which no kernel wrote) are zeroed and the host's sum is
added into the first of each token's rows, on the compute stream behind its copy to the device. The
launching thread waits for the host's result there: by then the device is busy with the work queued
for the layer, which the split sized to take as long.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from ferry.services.worker.offload.host_compute.host_experts import HostExperts


@dataclass(frozen=True)
class HostCost:
    """Measured costs, seconds: one expert's copy over PCIe; one expert computed on the host for n tokens,
    `host_s_at_1 + host_s_per_token x (n - 1)`; the per-layer hand-off. `max_step_tokens` and
    `max_tokens_per_expert`: the largest step and tokens an expert they were measured at (calibrate); the
    host takes nothing beyond them (unbounded for a rule rather than a measurement, as `cpu`'s)."""

    pcie_s: float
    host_s_at_1: float
    host_s_per_token: float
    overhead_s: float
    max_step_tokens: float = math.inf
    max_tokens_per_expert: float = math.inf

    def host_s(self, tokens_per_expert: float) -> float:
        return self.host_s_at_1 + self.host_s_per_token * max(0.0, tokens_per_expert - 1)

    def host_count(self, missed: int, tokens_per_expert: float, step_tokens: int = 0) -> int:
        """How many of a layer's `missed` experts the host takes (module docstring), 0 where the
        hand-off alone costs more than what the host would save the link, and for a step of
        `step_tokens` (or tokens an expert) beyond what the costs were measured at."""
        if missed < 1 or step_tokens > self.max_step_tokens or tokens_per_expert > self.max_tokens_per_expert:
            return 0
        host = self.host_s(tokens_per_expert)
        h = math.floor((missed * self.pcie_s - self.overhead_s) / (self.pcie_s + host))
        h = max(0, min(missed, h))

        def layer_s(n: int) -> float:  # the step's layer time with n experts on the host
            return max((missed - n) * self.pcie_s, self.overhead_s + n * host)

        h = min((h, min(h + 1, missed)), key=layer_s)  # the balance point rounded down or up: the shorter
        # take the host only where that is shorter than the link alone
        return h if h and layer_s(h) < missed * self.pcie_s else 0


class HostShare:
    """The host's part of streamed layers: `experts` (HostExperts over the store's banks), `cost`
    (HostCost), buffers for steps of up to `max_tokens` tokens of `top_k` pairs, hidden size H."""

    def __init__(self, experts: HostExperts, cost: HostCost, max_tokens: int, top_k: int, device: torch.device):
        self.experts, self.cost, self.device = experts, cost, torch.device(device)
        self._cuda = self.device.type == "cuda"
        h = experts.hidden_size
        pin = self._cuda
        self._x = torch.empty(max_tokens, h, dtype=experts.dtype, pin_memory=pin)
        self._ids = torch.empty(max_tokens, top_k, dtype=torch.int64, pin_memory=pin)
        self._weights = torch.empty(max_tokens, top_k, dtype=torch.float32, pin_memory=pin)
        self._out = torch.empty(max_tokens, h, dtype=torch.float32, pin_memory=pin)
        self._out_free: torch.cuda.Event | None = None  # the last copy of _out to the device has run
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-share")
        self.computed = 0  # experts computed on the host since boot
        self.layers = 0  # layers that took a host share since boot

    def follow_host_price(self, host_s_at_1: float) -> None:
        """The one-token price of a host expert as the decode share refined it in service (decode_share.py:
        the same kernel over the same banks, timed by its host nodes), in place of boot's calibration;
        the price of more tokens an expert stays the calibrated one."""
        self.cost = replace(self.cost, host_s_at_1=host_s_at_1)

    def split(self, missed: list[int], tokens: int, top_k: int, num_experts: int) -> tuple[list[int], list[int]]:
        """(experts to stage, experts for the host) of one layer's missed experts, for a step of `tokens`."""
        h = self.cost.host_count(len(missed), tokens * top_k / num_experts, tokens)
        return missed[: len(missed) - h], missed[len(missed) - h :]

    def start(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, real: int, host_experts: np.ndarray
    ) -> Future:
        """Queue the copies of the layer's input and routing to the host and hand the layer's host pairs
        (rows below `real`, experts in `host_experts`) to the host thread; returns its Future."""
        t = x.shape[0]
        if t > self._x.shape[0] or ids.shape[1] != self._ids.shape[1]:
            raise ValueError(
                f"a step of {t} tokens x {ids.shape[1]} exceeds the host share's buffers "
                f"({self._x.shape[0]} x {self._ids.shape[1]})"
            )
        xs, ids_h, w_h = self._x[:t], self._ids[:t], self._weights[:t]
        xs.copy_(x, non_blocking=self._cuda)
        ids_h.copy_(ids, non_blocking=self._cuda)
        w_h.copy_(weights, non_blocking=self._cuda)
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        self.layers += 1
        return self._thread.submit(self._compute, layer, xs, ids_h, w_h, real, host_experts, ready)

    def _compute(self, layer, xs, ids_h, w_h, real, host_experts, ready) -> torch.Tensor:
        if ready is not None:
            ready.synchronize()
        ids = ids_h[:real].numpy()
        mine = np.isin(ids, host_experts)
        tok, j = np.nonzero(mine)
        pairs = list(zip(tok.tolist(), ids[tok, j].tolist(), w_h[:real].numpy()[tok, j].tolist()))
        self.computed += len(np.unique(ids[tok, j]))
        return self.experts.compute(layer, xs, pairs)

    def finish(self, done: Future, rows: torch.Tensor, host_mask: torch.Tensor) -> None:
        """Fold the host's sum into the layer's rows [T, k, H]: the host pairs' rows zeroed (`host_mask`
        [T, k]), the sum added to each token's first row, behind its copy to the device. Rows in the model's
        dtype (a step past ROWS_FLOAT32_MAX_TOKENS, kernels/expert_rows_sum.py) take it rounded once more."""
        rows.masked_fill_(host_mask.unsqueeze(-1), 0.0)
        out = done.result()
        t = out.shape[0]
        if self._cuda:
            if self._out_free is not None:
                self._out_free.synchronize()  # the last layer's copy out of the pinned buffer has run
            self._out[:t].copy_(out)
            on_device = self._out[:t].to(self.device, non_blocking=True)
            self._out_free = torch.cuda.Event()
            self._out_free.record(torch.cuda.current_stream(self.device))
        else:
            on_device = out
        rows[:, 0].add_(on_device)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


# the sizes `calibrate` times: the hand-off of a step of this many tokens, the host's kernel at 1 and at this
# many tokens an expert
CALIBRATED_STEP_TOKENS = 512
CALIBRATED_TOKENS_PER_EXPERT = 16


def _median_s(fn, repeats: int, cuda: bool) -> float:
    """The median seconds of `fn(call)` over `repeats` calls, after one untimed (call 0): first-use costs
    (the C kernel's pool, a copy's first pages) stay out of the timing."""
    import statistics
    import time

    fn(0)
    times = []
    for call in range(1, repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(call)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe(call: int, n: int, layers: int, num_experts: int) -> tuple[int, list[int]]:
    """The MoE layer and the `n` experts the `call`-th timed call reads: ones no earlier call read, while
    the model has that many, so each call reads host RAM as a decode step's misses do. Reading the same
    few experts again would time what the call before left in the CPU's last-level cache: a faster host
    than the one the split then relies on."""
    layer = call % layers
    base = (call // layers) * n % num_experts
    return layer, [(base + i) % num_experts for i in range(n)]


def calibrate(store, experts: HostExperts, device: torch.device, probe_experts: int = 8, repeats: int = 5) -> HostCost:
    """The HostCost of this machine, measured at boot on the store's own paths: the staging ring's copy of
    `probe_experts` experts (the copy engine, or the unpacking kernel for packed banks), HostExperts
    computing them for 1 and CALIBRATED_TOKENS_PER_EXPERT tokens each, fresh experts each call (`probe`), and
    a hand-off of a CALIBRATED_STEP_TOKENS-token layer (its input and routing to the host, a result back) with
    nothing to compute. Those
    sizes bound the split (HostCost.max_step_tokens, max_tokens_per_expert)."""
    cuda = torch.device(device).type == "cuda"
    ring, h = store.ring, experts.hidden_size
    n = min(probe_experts, ring.size, experts.num_experts)
    shape = (experts.num_layers, experts.num_experts)

    def copy(call: int) -> None:
        layer, ids = probe(call, n, *shape)
        store.banks.copy_experts(layer, [(e, s) for s, e in enumerate(ids)], ring.w13, ring.w2, non_blocking=cuda)

    pcie = _median_s(copy, repeats, cuda) / n
    g = torch.Generator().manual_seed(0)
    x = torch.randn(CALIBRATED_TOKENS_PER_EXPERT, h, generator=g).to(experts.dtype)

    def host(tokens: int, first_call: int) -> float:
        def compute(call: int) -> None:
            layer, ids = probe(first_call + call, n, *shape)
            experts.compute(layer, x, [(t, e, 1.0) for e in ids for t in range(tokens)])

        return _median_s(compute, repeats, False) / n

    n_tok = CALIBRATED_TOKENS_PER_EXPERT
    at_1, at_n = host(1, repeats + 1), host(n_tok, 2 * (repeats + 1))  # past the experts the copies read
    top_k, step = 8, CALIBRATED_STEP_TOKENS
    share = HostShare(experts, HostCost(pcie, at_1, 0.0, 0.0), max_tokens=step, top_k=top_k, device=device)
    xs = torch.zeros(step, h, dtype=experts.dtype, device=device)
    ids = torch.zeros(step, top_k, dtype=torch.int64, device=device)
    weights = torch.zeros(step, top_k, dtype=torch.float32, device=device)
    rows = torch.zeros(step, top_k, h, dtype=torch.float32, device=device)
    mask = torch.zeros(step, top_k, dtype=torch.bool, device=device)
    nothing = np.zeros(0, dtype=np.int64)

    def hand_off(call: int) -> None:
        share.finish(share.start(0, xs, ids, weights, step, nothing), rows, mask)

    overhead = _median_s(hand_off, repeats, cuda)
    share.close()
    return HostCost(
        pcie_s=pcie,
        host_s_at_1=at_1,
        host_s_per_token=max(0.0, (at_n - at_1) / (n_tok - 1)),
        overhead_s=overhead,
        max_step_tokens=step,
        max_tokens_per_expert=n_tok,
    )
