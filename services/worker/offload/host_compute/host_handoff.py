"""How a decode layer's share reaches the host (decode_share.py): a host node, or a polled word.

`node`: a CUDA graph host node (cuLaunchHostFunc) runs the C function ferry_host_node on the
CUDA driver's callback thread. Each layer pays the driver's round trip: the GPU signals the driver, its
thread wakes and runs the function, then signals the GPU back. Boot measures a layer's whole hand-off with
nothing for the host at ~59 µs, ~0.7 ms of a 12-layer token.

`poll`: the GPU writes the layer's number + 1 to a word in pinned memory (cuStreamWriteValue32, after the
pairs and the input are staged in pinned memory), then waits until a second word holds it (cuStreamWaitValue32) and
clears it; a thread of the C library (kernels/host_experts_c/host_poller.h) spins on the first word,
computes the layer's task and answers in the second. Both are stream memory operations, which a CUDA graph
captures. The thread spins for POLL_SPIN_NS after a layer, then naps between looks, from 20 µs doubling
up to 1 ms: an idle server costs about 1 % of a core, and the first layer after a pause waits up to a nap.

`auto` (the default): boot calibrates both and keeps the faster (a polled hand-off that the driver cannot
capture, or that never answers, leaves the host node). FERRY_HOST_HANDOFF=node|poll|auto picks. A polled
round can take 15.9 µs with the layer's copies against the host node's 42.1, and the 12-layer cut's single
stream 1.548x the GPU alone polled against 1.386x by host nodes; which wins depends on the host and driver.

On CPU (the tests, under the Triton interpreter) there is no GPU to write the words: `play_on_host` does
what the GPU's operations would, so the same thread and protocol run there.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
import weakref

import torch

HANDOFF_ENV = "FERRY_HOST_HANDOFF"
HANDOFFS = ("node", "poll", "auto")
DEFAULT_HANDOFF = "auto"
POLL_SPIN_NS = 2_000_000  # the thread spins this long after a layer: a decode step's layers come well within it
STUCK_S = 5.0  # a polled round unanswered this long: the thread is not answering (calibration gives up on it)
GO, DONE = 0, 64  # the words' byte offsets in ferry_poll_flags (host_poller.h)
WAIT_VALUE_EQ = 0x1  # CU_STREAM_WAIT_VALUE_EQ
WRITE_VALUE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: after the stream's earlier work, with a memory barrier


def resolve_handoff(value: str | None = None) -> str:
    """`value`, else FERRY_HOST_HANDOFF, else the default; ValueError naming the variable for anything else."""
    chosen = (value if value is not None else os.environ.get(HANDOFF_ENV, "")).strip().lower() or DEFAULT_HANDOFF
    if chosen not in HANDOFFS:
        raise ValueError(f"{HANDOFF_ENV}={chosen!r}: expected one of {', '.join(HANDOFFS)}")
    return chosen


def choose_handoff(wanted: str, node_s: float, poll_s: float | None) -> str:
    """The hand-off boot keeps: `poll` where asked and it answered, or under `auto` where it measured faster
    than the host node; `node` otherwise (poll_s None: the polled hand-off could not be captured or run)."""
    if poll_s is None or wanted == "node":
        return "node"
    return "poll" if wanted == "poll" or poll_s < node_s else "node"


@functools.cache
def _driver() -> dict:
    """The driver's stream memory operations and cuMemHostGetDevicePointer (v2), with their ctypes signatures."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def entry(*names):
        for name in names:
            if hasattr(cuda, name):
                return getattr(cuda, name)
        raise RuntimeError(f"libcuda has none of {', '.join(names)}: no polled hand-off on this driver")

    # the v2 entry points only: v1's memory operations need a driver module parameter, and v1's
    # cuMemHostGetDevicePointer writes a 32-bit address
    write = entry("cuStreamWriteValue32_v2")
    wait = entry("cuStreamWaitValue32_v2")
    for fn in (write, wait):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
    device_pointer = entry("cuMemHostGetDevicePointer_v2")
    device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    device_pointer.restype = ctypes.c_int
    return {"write": write, "wait": wait, "device_pointer": device_pointer}


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed with CUDA error {err}")


def _stop_thread(lib, handle: int, held: tuple) -> None:
    """Stop and join the polling thread; `held` (its tasks and words) may go once this returns."""
    lib.ferry_poller_destroy(handle)


class Poller:
    """The C library's polling thread over `tasks` (HostNodeTask structures, one a MoE layer), answering a
    pair of words in pinned memory (`cuda`) or in plain memory (the CPU's play_on_host). close() stops it;
    so does the object's collection. Until the thread has stopped, it holds the tasks, the words and `keep`
    (what the tasks point at: the host kernel, whose pool the tasks run on, and the share's pinned buffers),
    whatever order their owner's attributes go in. Graphs captured with it must be gone before it stops:
    their waits would never be answered."""

    def __init__(self, lib, tasks: list, cuda: bool, keep: tuple = ()):
        self.lib, self.cuda = lib, cuda
        self.flags = torch.zeros(int(lib.ferry_poll_flags_size()), dtype=torch.uint8, pin_memory=cuda)
        self._tasks = tasks
        self._task_ptrs = (ctypes.c_void_p * len(tasks))(*[ctypes.addressof(t) for t in tasks])
        handle = lib.ferry_poller_create(self._task_ptrs, len(tasks), self.flags.data_ptr(), POLL_SPIN_NS)
        if not handle:
            raise RuntimeError("the host's polling thread did not start")
        self.handle = handle
        # the thread reads the tasks and the words until it stops: the finalizer holds them until then
        self._stop = weakref.finalize(self, _stop_thread, lib, handle, (self._task_ptrs, tasks, self.flags, keep))
        self._pending = 0  # the last number hand_over queued: what a stalled device waits for
        self._go = ctypes.c_uint32.from_address(self.flags.data_ptr() + GO)
        self._done = ctypes.c_uint32.from_address(self.flags.data_ptr() + DONE)
        self._go_dev = self._done_dev = None
        if cuda:
            base = ctypes.c_uint64()
            _check(
                _driver()["device_pointer"](ctypes.byref(base), ctypes.c_void_p(self.flags.data_ptr()), 0),
                "cuMemHostGetDevicePointer",
            )
            self._go_dev, self._done_dev = base.value + GO, base.value + DONE

    def rounds(self) -> int:
        """Layers the thread has answered."""
        return int(self.lib.ferry_poller_rounds(self.handle)) if self._stop.alive else 0

    def hand_over(self, stream: int, layer: int) -> None:
        """On `stream` (a raw CUDA stream, capturing or not): go = layer + 1, wait until done holds it, clear done."""
        drv, value = _driver(), layer + 1
        self._pending = value
        _check(drv["write"](stream, self._go_dev, value, WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")
        _check(drv["wait"](stream, self._done_dev, value, WAIT_VALUE_EQ), "cuStreamWaitValue32")
        _check(drv["write"](stream, self._done_dev, 0, WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")

    def play_on_host(self, layer: int) -> None:
        """What hand_over's three operations do on the GPU, done from this thread (CPU steps)."""
        value = layer + 1
        self._go.value = value
        deadline = time.monotonic() + STUCK_S
        while self._done.value != value:
            if time.monotonic() > deadline:
                self._go.value = 0
                raise RuntimeError(f"the host's polling thread did not answer layer {layer} in {STUCK_S} s")
        self._done.value = 0

    def wait_or_release(self, event) -> None:
        """Wait for `event` (a torch.cuda.Event recorded after polled hand-offs, spun on, not slept on: boot
        times hand-offs by this wait). If they go unanswered for STUCK_S, answer every one from here (the
        number in `go`, or, where the thread took it and stalled, the last one queued) until the event is
        reached, then RuntimeError; if even that does not release the device within STUCK_S more (the GPU's
        writes never reach this memory), the device cannot be used again: SystemExit, naming the variable."""
        deadline = time.monotonic() + STUCK_S
        while not event.query():
            if time.monotonic() < deadline:
                continue
            deadline += STUCK_S
            while not event.query():  # the thread is not answering: release the device's waits ourselves
                value = self._go.value or self._pending
                self._go.value = 0
                self._done.value = value
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"a polled hand-off to the host left the GPU waiting and could not be "
                        f"released; set {HANDOFF_ENV}=node"
                    )
            raise RuntimeError(f"the host's polling thread left a hand-off unanswered for {STUCK_S} s")

    def close(self) -> None:
        self._stop()
