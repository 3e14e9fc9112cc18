"""The polled hand-off of decode layers to the host (services/worker/offload/host_compute/host_handoff.py,
kernels/host_experts_c/host_poller.c), on CPU: the polling thread answers each layer's word with that
layer's task, as the host node would have computed it, counts the layers, refuses a number no layer has
(zeros and an error for the step's end), and stops with the share. Which hand-off boot keeps, and the
variable that picks it. On CUDA the GPU writes and waits on the words (tests/gpu/test_device_decode_cuda.py)."""

from __future__ import annotations

import time

import pytest
import torch

from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute import host_handoff as H
from ferry.services.worker.offload.host_compute.decode_share import HostDecodeShare
from ferry.services.worker.offload.host_compute.host_expert_kernel import HostKernel
from tests.unit.offload.test_host_expert_kernel import make_banks

needs_library = pytest.mark.skipif(K.library()[0] is None, reason=f"host kernel not built: {K.library()[1]}")


def _share(threads: int = 2) -> tuple[HostDecodeShare, HostKernel]:
    banks = make_banks("bf16", 256, 160)
    kernel = HostKernel(banks, torch.bfloat16, threads=threads)
    return HostDecodeShare(
        kernel, (1, 1, 0, 0), max_tokens=4, top_k=2, num_experts=banks.num_experts, device="cpu"
    ), kernel


def _listed(share: HostDecodeShare, x: torch.Tensor, pairs: list) -> None:
    """The pairs and the input as the device would have copied them to pinned memory."""
    p = share.pinned
    for i, (t, e, w) in enumerate(pairs):
        p.pair_token[i], p.pair_expert[i], p.pair_weight[i] = t, e, w
    p.meta[0], p.meta[1] = x.shape[0], len(pairs)
    share._x[: x.shape[0]] = x


@needs_library
def test_the_polling_thread_answers_each_layer_with_its_task():
    share, kernel = _share()
    share.use_poll()
    assert share.handoff == "poll" and share.poller is not None
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    pairs = [(0, 4, 0.25), (2, 1, 0.5), (2, 4, 0.75), (1, 5, 1.0)]
    _listed(share, x, pairs)
    for round_, layer in enumerate((1, 0, 1)):
        share._out.fill_(float("nan"))
        share.poller.play_on_host(layer)
        assert torch.equal(share._out[:3], kernel.compute(layer, x, pairs)), layer
        assert share.poller.rounds() == round_ + 1
    assert share.tasks[1].calls == 2 and share.tasks[0].calls == 1 and share.tasks[1].pairs == 2 * len(pairs)
    share.check()
    assert share.report()["handoff"] == "poll" and share.report()["polled_layers"] == 3
    time.sleep(0.01)  # past its spin: the thread naps between looks, and still answers
    share.poller.play_on_host(0)
    assert share.poller.rounds() == 4


@needs_library
def test_a_number_no_layer_has_gives_zeros_and_fails_the_step():
    share, _ = _share(threads=1)
    share.use_poll()
    _listed(share, torch.zeros(2, 256, dtype=torch.bfloat16), [(0, 1, 1.0)])
    for past in (len(share.tasks), len(share.tasks) + 3):  # the first number no layer has, and one further
        share._out.fill_(float("nan"))
        share.poller.play_on_host(past)
        assert torch.equal(share._out, torch.zeros_like(share._out))
        with pytest.raises(RuntimeError, match="MoE layer 0 failed: host pairs out of range"):
            share.check()
        share.check()


@needs_library
def test_the_thread_stops_with_the_share_and_node_hand_offs_come_back(monkeypatch):
    share, kernel = _share()
    share.use_poll()
    poller = share.poller
    share.use_poll()  # already polling: the same thread
    assert share.poller is poller
    share.use_node()
    assert share.handoff == "node" and share.poller is None and poller.rounds() == 0
    monkeypatch.setattr(H, "STUCK_S", 0.05)
    with pytest.raises(RuntimeError, match="did not answer layer 0"):  # nobody answers a stopped thread's word
        poller.play_on_host(0)
    share.use_poll()
    assert share.poller is not poller and share.poller.rounds() == 0


def test_the_variable_picks_the_hand_off_and_a_bad_value_names_it(monkeypatch):
    monkeypatch.delenv(H.HANDOFF_ENV, raising=False)
    assert H.resolve_handoff() == H.DEFAULT_HANDOFF == "auto"
    for value in ("poll", "AUTO", " node "):
        monkeypatch.setenv(H.HANDOFF_ENV, value)
        assert H.resolve_handoff() == value.strip().lower()
    monkeypatch.setenv(H.HANDOFF_ENV, "interrupt")
    with pytest.raises(ValueError, match="FERRY_HOST_HANDOFF='interrupt': expected one of node, poll, auto"):
        H.resolve_handoff()


@pytest.mark.parametrize(
    "wanted, node_s, poll_s, kept",
    [
        ("node", 60e-6, 10e-6, "node"),  # asked for the host node: kept whatever the poll measured
        ("auto", 60e-6, 10e-6, "poll"),  # auto: the faster
        ("auto", 20e-6, 30e-6, "node"),
        ("poll", 20e-6, 30e-6, "poll"),  # asked for: kept even where slower
        ("poll", 20e-6, None, "node"),  # not capturable or unanswered: the host node
        ("auto", 20e-6, None, "node"),
    ],
)
def test_boot_keeps_the_hand_off_asked_for_or_the_faster(wanted, node_s, poll_s, kept):
    assert H.choose_handoff(wanted, node_s, poll_s) == kept


@needs_library
def test_the_graphs_operations_write_go_then_wait_on_done_then_clear_it(monkeypatch):
    """What hand_over queues on the stream (a recording stand-in for the driver here): the layer's number
    + 1 written to the first word, a wait until the second holds it (EQ), the second cleared, in that
    order, at the words' device addresses, all with the default write flags."""
    share, _ = _share()
    share.use_poll()
    calls = []
    record = lambda name: lambda stream, addr, value, flags: calls.append((name, stream, addr, value, flags)) or 0  # noqa: E731
    monkeypatch.setattr(H, "_driver", lambda: {"write": record("write"), "wait": record("wait")})
    poller = share.poller
    poller._go_dev, poller._done_dev = 0x1000 + H.GO, 0x1000 + H.DONE
    poller.hand_over(77, 2)
    assert calls == [
        ("write", 77, 0x1000, 3, H.WRITE_VALUE_DEFAULT),
        ("wait", 77, 0x1040, 3, H.WAIT_VALUE_EQ),
        ("write", 77, 0x1040, 0, H.WRITE_VALUE_DEFAULT),
    ]
    assert H.GO == 0 and H.DONE == 64 and int(share.kernel.lib.ferry_poll_flags_size()) == 128  # host_poller.h's layout


class _Device:
    """A device stand-in waiting on the words as the graph would: go = value, then done == value, then done
    = 0; its event is reached once its waits are answered."""

    def __init__(self, poller, values):
        self.poller, self.values = poller, list(values)
        self._next()

    def _next(self):
        if self.values:
            self.poller._go.value = self.values[0]

    def query(self) -> bool:
        if self.values and self.poller._done.value == self.values[0]:
            self.poller._done.value = 0
            self.values.pop(0)
            self._next()
        return not self.values


@needs_library
@pytest.mark.parametrize("taken", [False, True])
def test_the_watchdog_answers_a_stalled_hand_off_and_then_fails(monkeypatch, taken):
    """Boot's calibration waits for polled hand-offs through wait_or_release: if the thread does not answer
    within STUCK_S, it answers every wait itself (the number in go, or, where the thread had taken it and
    stalled, the last one queued) so the device goes on, then raises; a device that goes on is waited for."""
    share, _ = _share()
    share.use_poll()
    poller = share.poller
    monkeypatch.setattr(H, "STUCK_S", 0.05)
    device = _Device(poller, [1, 1, 1])
    while device.values:  # the live thread answers: no error
        poller.wait_or_release(device)
    share.use_node()  # a thread that answers nothing from here
    poller._pending = 1
    device = _Device(poller, [1, 1])
    if taken:
        poller._go.value = 0  # taken by a thread that then stalled: only the queued number says what to answer
    with pytest.raises(RuntimeError, match="left a hand-off unanswered"):
        poller.wait_or_release(device)
    assert not device.values  # every wait answered: the device went on


@needs_library
def test_a_device_that_cannot_be_released_stops_the_worker_naming_the_variable(monkeypatch):
    share, _ = _share(threads=1)
    share.use_poll()
    poller = share.poller
    share.use_node()
    monkeypatch.setattr(H, "STUCK_S", 0.02)

    class Deaf:  # the GPU's writes never reach this memory: nothing releases it
        def query(self):
            return False

    with pytest.raises(SystemExit, match="FERRY_HOST_HANDOFF=node"):
        poller.wait_or_release(Deaf())


@needs_library
@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="thread affinity is Linux's")
def test_the_polling_thread_runs_on_the_callers_cpu():
    import os

    from tests.unit.offload.test_host_expert_kernel import _thread_cpus

    allowed = sorted(os.sched_getaffinity(0))
    banks = make_banks("bf16", 256, 160)
    kernel = HostKernel(banks, torch.bfloat16, threads=1, cpus=[allowed[0]])  # one thread: the caller alone
    share = HostDecodeShare(kernel, (1, 1, 0, 0), max_tokens=4, top_k=2, num_experts=banks.num_experts, device="cpu")
    before = set(_thread_cpus())
    share.use_poll()
    _listed(share, torch.zeros(1, 256, dtype=torch.bfloat16), [(0, 1, 1.0)])
    share.poller.play_on_host(0)  # answered: the thread has started and pinned itself first
    started = [cpus for tid, cpus in _thread_cpus().items() if tid not in before]  # torch's may start too
    assert str(allowed[0]) in started and kernel.caller_pinned == 1
    if len(allowed) > 1:  # one thread pinned there, and this one not
        assert started.count(str(allowed[0])) == 1 and os.sched_getaffinity(0) == set(allowed)
    share.use_node()
