"""The host's share of a decode layer's misses: the host computes some, the link carries the rest.

On the graph-safe decode path (stores/device_driven.py) a layer's missed experts cross PCIe one after another while
the GPU waits; at one stream the link is full (the 12-layer cut ran at 0.9 of its bound). The host can compute a
missed expert where it lies, from the same banks, about as fast as the link moves one (148 µs for a packed Qwen3-30B
expert on a server host against 129 µs over PCIe), so splitting each layer's misses between the two roughly halves
the layer's wait.

Per layer, inside the step's CUDA graph (no host round trip; the split is decided on the device):

    lookup ─▶ hand-off kernel (kernels/expert_host_handoff.py): the last h misses go to the host
              │      (slots back to what they held, pairs listed, the copy kernel's count cut to m - h)
              ├─▶ copy stream: the m - h copies, as before
              └─▶ host stream: pair list and x to pinned memory (one kernel) ─▶ host node (the C kernel's
                  ferry_host_node on the driver's callback thread) ─▶ its float32 sum in pinned memory
    hits' GEMV ─▶ wait for the copies ─▶ misses' GEMV ─▶ wait for the host ─▶ fold kernel: host pairs'
    rows zeroed, the host's sum read from pinned memory and added to each token's first row

The moves to and from pinned memory are the GPU's own loads and stores through the buffers' mapped
addresses (kernels/host_share_rows.py), not copy-engine copies: beside the next layer's prefetch, which
fills the host-to-device direction, those copies made a hand-off 256 µs instead of 45.

Why a host node rather than an event-driven hand-off to a Python thread: the decode step is one graph
replay, and a host node keeps it one; the C function runs without Python or the GIL, so the worker's
own thread stays free to launch the next step (scheduling ahead). CUDA runs host nodes one at a time
on its callback thread: one layer's share at a time, which is what the step needs. The same C function
can instead be handed its layers by a polled word in pinned memory, written and waited on by the graph's
stream memory operations (host_handoff.py: `use_poll`, FERRY_HOST_HANDOFF), without the driver's round trip.

With the next-layer prefetch on, the prefetch of layer L+1 already leaves the host its share of the
predicted experts (kernels/expert_cache_lookup.py, HAS_HOST): copying them ahead would spend the link on
what the host computes anyway, and the host can only compute at their layer, once its input exists.
Layer L+1's hand-off then counts the prefetched experts as load the link already carries.

The split's costs are integer nanoseconds (`costs_ns`): a PCIe copy of one expert, the host's
computation of one for 1 and for each more token, and the hand-off itself, measured at boot
(`calibrate_handoff`, with host_share.calibrate for the rest). On CPU (the tests, under the Triton
interpreter) the same kernel and the same C function run synchronously.
"""

from __future__ import annotations

import ctypes
import functools
import statistics
import time
from dataclasses import dataclass

import structlog
import torch

from ferry.kernels.expert_host_handoff import hand_to_host
from ferry.kernels.host_share_rows import fold_host_sum, stage_for_host
from ferry.services.worker.offload.host_compute.host_expert_kernel import ERRORS, HostKernel, Job
from ferry.services.worker.offload.host_compute.host_handoff import Poller
from ferry.services.worker.offload.host_compute.share_guard import ShareGuard

log = structlog.get_logger("worker.offload")

# host experts between two refinements of the split's price of one (HostDecodeShare.refine): a few
# hundred decode steps of a single stream, enough that one slow step does not move it
REFINE_EVERY = 2048
# a window of more pairs an expert than this is not used to refine the one-token price: its time mixes
# in the price of more tokens, which the nodes' clock cannot separate (at 8 streams the
# calibrated 26 µs a token, taken off, left a one-token price below what the nodes took)
REFINE_MAX_PAIRS_PER_EXPERT = 1.25

# the price of a host expert while auto's guard has the share off (share_guard.py): the hand-off then gives
# the host nothing, a second being more than any layer's copies
OFF_PRICE_NS = 10**9

NODE_HIST = 9  # FERRY_NODE_HIST (host_node.h): buckets of a host node's wall time, the last unbounded

HOST_NODE_ERRORS = {**ERRORS, -4: "host pairs out of range (the device listed a token or expert past the buffers)"}


class HostNodeTask(ctypes.Structure):
    """ferry_host_node_task (kernels/host_experts_c/host_node.h)."""

    _fields_ = [
        ("kernel", ctypes.c_void_p),
        ("job", Job),
        ("meta", ctypes.c_void_p),
        ("num_experts", ctypes.c_int64),
        ("max_tokens", ctypes.c_int64),
        ("max_pairs", ctypes.c_int64),
        ("pin_caller", ctypes.c_int64),
        ("status", ctypes.c_int64),
        ("calls", ctypes.c_int64),
        ("pairs", ctypes.c_int64),
        ("busy_ns", ctypes.c_int64),
        ("busy_calls", ctypes.c_int64),
        ("busy_hist", ctypes.c_int64 * NODE_HIST),
    ]


@functools.cache
def _launch_host_func():
    """cuLaunchHostFunc from the driver (capturable: it becomes a host node of the graph being captured)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = cuda.cuLaunchHostFunc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@dataclass
class HostDecodeBuffers:
    """What the hand-off kernel writes (device) and its pinned copies: per pair a host flag, the host's
    compacted pairs (token row, expert, router weight), meta [T, pairs], totals [experts, pairs]. Meta
    and the pairs are views of one byte block, so one kernel stages them for the host (host_share_rows.py)."""

    host_pairs: torch.Tensor
    pair_token: torch.Tensor
    pair_expert: torch.Tensor
    pair_weight: torch.Tensor
    meta: torch.Tensor
    totals: torch.Tensor
    block: torch.Tensor  # uint8: meta, pair_token, pair_expert (int64), pair_weight (float32), in that order

    @classmethod
    def make(cls, max_pairs: int, device: torch.device, pin: bool = False) -> HostDecodeBuffers:
        def empty(n, dtype):
            return torch.zeros(n, dtype=dtype, device=device, pin_memory=pin)

        p = max_pairs
        block = empty(8 * (2 + 2 * p) + 4 * p, torch.uint8)
        ints = block[: 8 * (2 + 2 * p)].view(torch.int64)
        return cls(
            empty(p, torch.int8),
            ints[2 : 2 + p],
            ints[2 + p :],
            block[8 * (2 + 2 * p) :].view(torch.float32),
            ints[:2],
            empty(2, torch.int64),
            block,
        )


@dataclass
class Handed:
    """One layer's hand-off in flight: when the host's sum is in the pinned buffer (None: it already is)."""

    done: torch.cuda.Event | None


class HostDecodeShare:
    """The host's share of decode layers over `kernel` (the C HostKernel over the store's banks), for
    steps of up to `max_tokens` tokens of `top_k` pairs; `costs_ns` as the hand-off kernel takes them."""

    def __init__(
        self,
        kernel: HostKernel,
        costs_ns: tuple[int, int, int, int],
        max_tokens: int,
        top_k: int,
        num_experts: int,
        device: torch.device,
    ):
        self.kernel, self.device = kernel, torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._costs_ns = tuple(int(c) for c in costs_ns)
        self.costs = torch.tensor(self._costs_ns, dtype=torch.int64, device=self.device)
        self._costs_staged = torch.zeros(4, dtype=torch.int64, pin_memory=self._cuda)  # an upload's source
        self._uploaded: torch.cuda.Event | None = None
        self.refines = True  # off where the costs are not prices (--expert-backend cpu: expert_backends.py)
        self.on_refined = None  # called with each new one-token price (seconds): the prefill's share follows it
        self.refinements = 0
        self.guard: ShareGuard | None = None  # auto's check of the share against the steps (expert_backends.py)
        # decode launches of fewer rows than this hand nothing over and hold no hand-off (auto's choice, by the
        # calibration: a node costs every layer it is in, and a single stream's few misses may not pay for it)
        self.min_tokens = 1
        self._price_ns = self._costs_ns  # the prices as calibrated and refined; _costs_ns applies the guard's scale
        self._scale: float | None = 1.0  # the guard's: the host's one-token price scaled by it (None: off)
        self._refined_from = (0, 0, 0)  # (busy ns, experts, pairs) at the last refinement
        self._no_flight = torch.zeros(1, dtype=torch.int32, device=self.device)  # a layer nothing prefetched
        self.handed_experts = self.handed_pairs = 0  # since boot, as of the last step folded (count)
        self.max_tokens, self.top_k, self.max_pairs = max_tokens, top_k, max_tokens * top_k
        h = kernel.hidden
        self.dev = HostDecodeBuffers.make(self.max_pairs, self.device)
        self.pinned = HostDecodeBuffers.make(self.max_pairs, torch.device("cpu"), pin=self._cuda)
        self._x = torch.zeros(max_tokens, h, dtype=kernel.dtype, pin_memory=self._cuda)
        self._out = torch.zeros(max_tokens, h, dtype=torch.float32, pin_memory=self._cuda)
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        p = self.pinned
        self.tasks = []
        for w13, w2 in kernel.families:  # one task a MoE layer: its families, the shared pinned buffers
            job = Job(
                format=kernel.format,
                act=kernel.act,
                isa=kernel.isa_code,
                tokens=0,
                hidden=h,
                inter=kernel.inter,
                x=self._x.data_ptr(),
                n_pairs=0,
                pair_token=p.pair_token.data_ptr(),
                pair_expert=p.pair_expert.data_ptr(),
                pair_weight=p.pair_weight.data_ptr(),
                w13=w13,
                w2=w2,
                out=self._out.data_ptr(),
                swiglu_limit=kernel.swiglu_limit,
                swiglu_alpha=kernel.swiglu_alpha,
                activation=kernel.activation,
            )
            # pin_caller: on CUDA the driver's callback thread runs the nodes and nothing else, so it takes the
            # pool's caller CPU (thread_pool.c); on CPU the nodes run on the caller's own thread
            self.tasks.append(
                HostNodeTask(
                    kernel=kernel.handle,
                    job=job,
                    meta=p.meta.data_ptr(),
                    num_experts=num_experts,
                    max_tokens=max_tokens,
                    max_pairs=self.max_pairs,
                    pin_caller=int(self._cuda),
                )
            )
        self._node = ctypes.cast(kernel.lib.ferry_host_node, ctypes.c_void_p).value
        self.poller: Poller | None = None  # the polled hand-off's thread (use_poll), None: host nodes

    def covers(self, tokens: int) -> bool:
        """Whether a decode launch of `tokens` rows (a graph's bucket) hands the host its share."""
        return tokens >= self.min_tokens

    @property
    def handoff(self) -> str:
        """How layers reach the host: `node` (a graph host node) or `poll` (host_handoff.py)."""
        return "node" if self.poller is None else "poll"

    def use_poll(self) -> None:
        """Hand layers over by polling from now on (graphs captured before keep their host nodes)."""
        if self.poller is None:  # the thread holds what its tasks point at until it has stopped
            self.poller = Poller(
                self.kernel.lib, self.tasks, self._cuda, keep=(self.kernel, self._x, self._out, self.pinned)
            )

    def use_node(self) -> None:
        """Hand layers over by host nodes from now on; the polling thread, if any, stops (graphs captured with
        it must be gone: boot chooses before it captures the decode graphs)."""
        if self.poller is not None:
            self.poller.close()
            self.poller = None

    @property
    def costs_ns(self) -> tuple[int, int, int, int]:
        """The costs the hand-off applies: the prices, the host's one-token one scaled by auto's guard."""
        return self._costs_ns

    @costs_ns.setter
    def costs_ns(self, costs: tuple[int, int, int, int]) -> None:
        """New prices (boot's calibration, `refine`, tests), applied under the guard's scale."""
        self._price_ns = tuple(int(c) for c in costs)
        self._apply()

    def _apply(self) -> None:
        """Upload the prices under the scale: the captured graphs read them from the device at run time. The
        upload is queued on the current stream from pinned memory, so it lands between the steps queued
        before and after it without the launching thread waiting for either."""
        pcie, at_1, per_token, handoff = self._price_ns
        if self._scale is None:
            host = OFF_PRICE_NS
        elif self._scale == 1.0 or at_1 == 0:
            host = at_1  # as priced; 0 is --expert-backend cpu's rule (every miss to the host), whatever the scale
        else:
            host = max(1, round(at_1 * self._scale))
        self._costs_ns = (pcie, host, per_token, handoff)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last upload has read the staging buffer
        self._costs_staged.copy_(torch.tensor(self._costs_ns, dtype=torch.int64))
        self.costs.copy_(self._costs_staged, non_blocking=self._cuda)
        if self._cuda:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record(torch.cuda.current_stream(self.device))

    def start(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        n_rows: torch.Tensor,
        call,
        cache,
        in_flight: torch.Tensor | None = None,
    ) -> Handed:
        """After the layer's lookup (`call`, over `cache`): the hand-off kernel on the current stream, then
        the host's part on the host stream (module docstring). `in_flight`: the count of the layer's
        prefetch (int32 [1] on the device), None without one. The copy kernel must be queued after this."""
        t, k = ids.shape
        if t > self.max_tokens or k != self.top_k:
            raise ValueError(
                f"a decode step of {t} tokens x {k} exceeds the host share's buffers ({self.max_tokens} x {self.top_k})"
            )
        weights = weights if weights.is_contiguous() else weights.contiguous()
        in_flight = self._no_flight if in_flight is None else in_flight
        hand_to_host(
            ids,
            weights,
            n_rows,
            call.miss_slots,
            call.misses,
            call.count,
            in_flight,
            cache,
            layer,
            self.costs,
            self.dev,
        )
        task = ctypes.addressof(self.tasks[layer])
        if not self._cuda:  # the interpreter's path: the same C function, now (polled: the GPU's part played here)
            self._to_pinned(x, t)
            if self.poller is not None:
                self.poller.play_on_host(layer)
            else:
                self.kernel.lib.ferry_host_node(task)
            return Handed(None)
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        self._stream.wait_event(ready)
        with torch.cuda.stream(self._stream):
            self._to_pinned(x, t)
            if self.poller is not None:
                self.poller.hand_over(self._stream.cuda_stream, layer)
            else:
                err = _launch_host_func()(self._stream.cuda_stream, self._node, task)
                if err:
                    raise RuntimeError(f"cuLaunchHostFunc failed with CUDA error {err}")
        done = torch.cuda.Event()
        done.record(self._stream)
        return Handed(done)

    def _to_pinned(self, x: torch.Tensor, t: int) -> None:
        """The pair block (meta and the pairs) and the layer's input rows to pinned memory, written by the GPU
        through their mapped addresses (kernels/host_share_rows.py: copy-engine copies queued behind the
        link's traffic)."""
        x = x[:t].to(self._x.dtype).contiguous()  # as the host kernel reads it (no copy where it already is)
        stage_for_host(self.dev.block, self.pinned.block, x, self._x)

    def finish(self, handed: Handed, rows: torch.Tensor) -> None:
        """Fold the host's sum into the layer's rows [T, k, H] float32 (their host pairs were never written):
        read by the fold kernel from the pinned buffer the host wrote, once the host is done."""
        if handed.done is not None:
            torch.cuda.current_stream(self.device).wait_event(handed.done)
        fold_host_sum(rows, self.dev.host_pairs, self._out)

    def check(self) -> None:
        """After a step has finished: RuntimeError if a host node failed (it cannot raise where it runs);
        the error is cleared, so the step that met it fails and the next ones run."""
        for layer, task in enumerate(self.tasks):
            if task.status:
                status, task.status = task.status, 0
                raise RuntimeError(
                    f"the host's share of MoE layer {layer} failed: {HOST_NODE_ERRORS.get(status, status)}"
                )

    def count(self, totals) -> None:
        """The device totals as the step's statistics copied them (experts, pairs since boot): what
        `report` says, without reading the device from the thread that asks."""
        self.handed_experts, self.handed_pairs = int(totals[0]), int(totals[1])

    def busy(self) -> tuple[int, int]:
        """(ns, calls) the host nodes spent computing pairs since boot, as the C function times them."""
        return sum(t.busy_ns for t in self.tasks), sum(t.busy_calls for t in self.tasks)

    def busy_histogram(self) -> tuple[list[float], list[int]]:
        """Those calls by wall time since boot: (the buckets' upper bounds in seconds, the calls in each, one
        more than the bounds: the last is every call past the last bound)."""
        bounds = (ctypes.c_int64 * (NODE_HIST - 1))()
        self.kernel.lib.ferry_host_node_hist_bounds(bounds)
        return [b / 1e9 for b in bounds], [sum(t.busy_hist[i] for t in self.tasks) for i in range(NODE_HIST)]

    def observe_step(self, now: float, decode_tokens: int | None) -> None:
        """A finished step, for auto's guard (share_guard.py): `now` its end (monotonic seconds),
        `decode_tokens` its tokens if every row decoded one, else None. Applies the guard's choice."""
        if self.guard is None:
            return
        if decode_tokens is not None and not self.covers(decode_tokens):
            decode_tokens = None  # a step without the share is no sample of it, on or off
        decided = len(self.guard.decisions)
        if self.guard.step(now, decode_tokens):
            self._scale = self.guard.scale
            self._apply()
        if len(self.guard.decisions) > decided:  # a choice made (kept or changed): logged with its medians
            log.info("host_decode_guard", **self.guard.decisions[-1])

    def refine(self) -> bool:
        """Every REFINE_EVERY host experts, move the split's price of one host expert at one token half way
        to what the host nodes took for them: boot's calibration times a few experts on an idle machine,
        while in service the host's threads share its memory with the copies, the api and the scheduler.
        The price of more tokens an expert is kept; it explains the measured time beyond one token a pair,
        in windows of mostly one token an expert (REFINE_MAX_PAIRS_PER_EXPERT); other windows are skipped.
        Returns whether the costs changed (after a step has been counted)."""
        ns, _ = self.busy()
        busy0, experts0, pairs0 = self._refined_from
        experts, pairs = self.handed_experts - experts0, self.handed_pairs - pairs0
        if experts < REFINE_EVERY:
            return False
        self._refined_from = (ns, self.handed_experts, self.handed_pairs)
        pcie, at_1, per_token, handoff = self._price_ns  # a scaled price is refined as the price under it
        if not self.refines or ns <= busy0 or self._scale is None:  # nothing timed, or the guard has it off
            return False
        if pairs > REFINE_MAX_PAIRS_PER_EXPERT * experts:  # many tokens an expert: not the one-token price
            return False
        measured = max(1, round((ns - busy0 - per_token * max(0, pairs - experts)) / experts))
        refined = (at_1 + measured) // 2
        self.costs_ns = (pcie, refined, per_token, handoff)
        self.refinements += 1
        if self.on_refined is not None:  # the same kernel over the same banks prices the prefill's share
            self.on_refined(refined / 1e9)
        log.info(
            "host_decode_refined",
            host_us_at_1=round(at_1 / 1e3, 1),
            measured_us=round(measured / 1e3, 1),
            refined_us=round(refined / 1e3, 1),
            experts=experts,
            pairs=pairs,
        )
        return True

    def report(self) -> dict:
        ns, calls = self.busy()
        per_expert = ns / self.handed_experts if self.handed_experts else 0.0
        guard = (
            None
            if self.guard is None
            else {
                "share_on": self.guard.share_on,
                "scale": self.guard.scale,
                "exploring": self.guard.exploring,
                "decisions": self.guard.decisions[-4:],
            }
        )
        bounds_s, counts = self.busy_histogram()
        return {
            "experts": self.handed_experts,
            "pairs": self.handed_pairs,
            "costs_ns": list(self._costs_ns),
            "price_ns": list(self._price_ns),
            "busy_ns": ns,
            "busy_calls": calls,
            "busy_ns_per_expert": round(per_expert),
            "busy_hist": {"bounds_s": bounds_s, "counts": counts},
            "refinements": self.refinements,
            "guard": guard,
            "handoff": self.handoff,
            "polled_layers": self.poller.rounds() if self.poller is not None else 0,
            "min_tokens": self.min_tokens,
        }


MAX_TRAFFIC_LAUNCHES = 64  # copy launches queued ahead of one timed replay: a slow replay queues no more


class LinkTraffic:
    """The decode path's own copy kernel (the banks' `copy_listed`: plain rows or the unpacking kernel) moving
    the staging ring's worth of experts of MoE layer 0 into the ring's slots, on a stream of its own: the
    traffic a decode layer's hand-off runs beside in service, the next layer's prefetch filling the
    host-to-device direction (the GPU's wait on a host word can take 157 µs a round beside the unpacking
    kernel against 9 µs alone). Boot times the hand-off with it and without."""

    def __init__(self, banks, ring, device: torch.device):
        self.banks, self.ring, self.device = banks, ring, torch.device(device)
        n = min(ring.size, banks.num_experts)
        self.misses = torch.tensor([[e, e] for e in range(n)], dtype=torch.int32, device=self.device)
        self.count = torch.tensor([n], dtype=torch.int32, device=self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.queue(1)  # compiled outside any timing
        self.stream.synchronize()
        t0 = time.perf_counter()
        self.queue(1)  # one launch's seconds, to queue enough ahead
        self.stream.synchronize()
        self.copy_s = time.perf_counter() - t0

    def queue(self, launches: int) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(launches):
                self.banks.copy_listed(0, self.ring.w13, self.ring.w2, self.misses, self.count)

    def cover(self, seconds: float) -> None:
        """Queue at least `seconds` of copies (and one launch more, at most MAX_TRAFFIC_LAUNCHES) behind what the
        stream already has."""
        self.queue(min(MAX_TRAFFIC_LAUNCHES, 1 + int(seconds / max(self.copy_s, 1e-6))))

    def drain(self) -> None:
        self.stream.synchronize()


def calibrate_handoff(share: HostDecodeShare, cache, repeats: int = 20, traffic: LinkTraffic | None = None) -> float:
    """Seconds of one layer's hand-off with nothing for the host (the hand-off kernel, the staging kernel, the
    host node or the polled round trip, and the fold kernel), as a one-token decode graph replays it: 8 in one
    captured graph, so its launch and the wait for it are not counted as the hand-off's. Uses its own
    lookup outputs with no misses, so the cache's maps are untouched. The host's own wake-up is in its
    per-expert cost. With `traffic`, the link is kept full through every timed replay, as a served layer's
    is by the next layer's prefetch."""
    k, dev = share.top_k, share.device
    ids = torch.zeros(1, k, dtype=torch.int64, device=dev)
    weights = torch.zeros(1, k, dtype=torch.float32, device=dev)
    n_rows = torch.ones(1, dtype=torch.int32, device=dev)
    x = torch.zeros(1, share.kernel.hidden, dtype=share.kernel.dtype, device=dev)
    rows = torch.zeros(1, k, share.kernel.hidden, dtype=torch.float32, device=dev)

    class NoMisses:
        miss_slots = torch.full((k,), -1, dtype=torch.int32, device=dev)
        misses = torch.zeros(cache.num_experts, 2, dtype=torch.int32, device=dev)
        count = torch.zeros(1, dtype=torch.int32, device=dev)

    def once():
        share.finish(share.start(0, x, ids, weights, n_rows, NoMisses, cache), rows)

    def chain():  # the graph's launch and the wait for it are spread over `chained` hand-offs
        for _ in range(chained):
            once()

    def settled() -> None:  # the device idle again, waited for alike in both hand-offs (an event spun on)
        if not share._cuda:
            return
        reached = torch.cuda.Event()
        reached.record()
        if share.poller is not None:  # a polled round unanswered must not hang boot
            share.poller.wait_or_release(reached)
        else:
            while not reached.query():
                pass

    chained = 8
    saved = share.dev.totals.clone()
    if share._cuda:
        once()  # compile the kernel outside the capture
        settled()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        run = graph.replay
    else:
        run = chain
    times = []
    try:
        for _ in range(repeats):
            if traffic is not None:  # the copies queued first start at once: the replay starts beside them
                traffic.cover(2 * (statistics.median(times) if times else 1e-3))
            t0 = time.perf_counter()
            run()
            settled()
            times.append(time.perf_counter() - t0)
    finally:  # the ring's slots are free again before boot goes on, even after a polled round went unanswered
        if traffic is not None:
            traffic.drain()
    share.dev.totals.copy_(saved)
    return statistics.median(times) / chained
