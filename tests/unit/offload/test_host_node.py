"""The decode graph's host node (kernels/host_experts_c/host_node.c,
services/worker/offload/host_compute/decode_share.py): called as CUDA calls it, with the pairs and meta the
device would have copied to pinned memory, it computes
what HostKernel.compute does for those pairs; pairs out of range are refused without reading the banks
(zeros out, an error kept for the step's end, where HostDecodeShare.check raises it)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from ferry.services.worker.offload.host_compute import host_expert_kernel as K
from ferry.services.worker.offload.host_compute.decode_share import HostDecodeShare
from ferry.services.worker.offload.host_compute.host_expert_kernel import HostKernel
from tests.unit.offload.test_host_expert_kernel import make_banks

pytestmark = pytest.mark.skipif(K.library()[0] is None, reason=f"host kernel not built: {K.library()[1]}")


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_the_host_node_computes_the_listed_pairs_as_the_kernel_does(fmt):
    banks = make_banks(fmt, 256, 160)
    kernel = HostKernel(banks, torch.bfloat16, threads=2)
    share = HostDecodeShare(kernel, (1, 1, 0, 0), max_tokens=4, top_k=2, num_experts=banks.num_experts, device="cpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    pairs = [(0, 4, 0.25), (2, 1, 0.5), (2, 4, 0.75), (1, 5, 1.0)]
    p = share.pinned
    for i, (t, e, w) in enumerate(pairs):
        p.pair_token[i], p.pair_expert[i], p.pair_weight[i] = t, e, w
    p.meta[0], p.meta[1] = 3, len(pairs)
    share._x[:3] = x
    for layer in (0, 1):
        share._out.fill_(float("nan"))
        kernel.lib.ferry_host_node(ctypes.addressof(share.tasks[layer]))
        assert torch.equal(share._out[:3], kernel.compute(layer, x, pairs))
    share.check()
    assert share.tasks[1].calls == 1 and share.tasks[1].pairs == len(pairs)
    ns, calls = share.busy()  # both layers' calls computed pairs, and timed themselves
    assert calls == 2 and ns > 0
    bounds, counts = share.busy_histogram()
    assert bounds == [50e-6 * 2**i for i in range(8)] and sum(counts) == 2 and len(counts) == 9
    p.meta[1] = 0  # a layer that gave the host nothing: called, not timed
    kernel.lib.ferry_host_node(ctypes.addressof(share.tasks[0]))
    assert share.tasks[0].calls == 2 and share.busy() == (ns, calls) and share.busy_histogram()[1] == counts
    p.meta[1] = len(pairs)  # one more: counted in the bucket its own time falls in
    kernel.lib.ferry_host_node(ctypes.addressof(share.tasks[0]))
    took = (share.busy()[0] - ns) / 1e9
    (bucket,) = [i for i, (a, b) in enumerate(zip(share.busy_histogram()[1], counts)) if a != b]
    edges = [0.0, *bounds, float("inf")]
    assert edges[bucket] < took <= edges[bucket + 1]
    assert share.report()["busy_hist"] == {"bounds_s": bounds, "counts": share.busy_histogram()[1]}


@pytest.mark.parametrize("bad", [(0, 6), (3, 1), (-1, 0)])
def test_a_pair_out_of_range_is_refused_and_raised_after_the_step(bad):
    banks = make_banks("bf16", 256, 160)
    share = HostDecodeShare(
        HostKernel(banks, torch.bfloat16, threads=1),
        (1, 1, 0, 0),
        max_tokens=4,
        top_k=2,
        num_experts=banks.num_experts,
        device="cpu",
    )
    p = share.pinned
    p.pair_token[0], p.pair_expert[0] = bad
    p.meta[0], p.meta[1] = 3, 1
    share._out.fill_(float("nan"))
    share.kernel.lib.ferry_host_node(ctypes.addressof(share.tasks[0]))
    assert torch.equal(share._out, torch.zeros_like(share._out))  # the layer gets zeros, not garbage
    with pytest.raises(RuntimeError, match="MoE layer 0 failed: host pairs out of range"):
        share.check()


def test_a_call_the_kernel_refuses_leaves_zeros_and_fails_one_step_only():
    banks = make_banks("bf16", 256, 160)
    share = HostDecodeShare(
        HostKernel(banks, torch.bfloat16, threads=1),
        (1, 1, 0, 0),
        max_tokens=4,
        top_k=2,
        num_experts=banks.num_experts,
        device="cpu",
    )
    p = share.pinned
    p.pair_token[0], p.pair_expert[0], p.pair_weight[0] = 0, 1, 1.0
    p.meta[0], p.meta[1] = 2, 1
    task = share.tasks[0]
    task.job.format = 99  # a job the C kernel refuses as invalid
    share._out.fill_(float("nan"))
    share.kernel.lib.ferry_host_node(ctypes.addressof(task))
    assert torch.equal(share._out, torch.zeros_like(share._out))  # not the previous layer's sum
    with pytest.raises(RuntimeError, match="MoE layer 0 failed: an invalid job"):
        share.check()
    share.check()  # cleared: the next step runs


def _timed(share: HostDecodeShare, busy_ns: int, experts: int, pairs: int) -> None:
    """As if the host nodes had computed `experts` experts of `pairs` pairs in `busy_ns` since boot."""
    share.tasks[0].busy_ns, share.tasks[0].busy_calls = busy_ns, experts
    share.count([experts, pairs])


def test_the_splits_price_of_a_host_expert_moves_half_way_to_what_the_nodes_took():
    from ferry.services.worker.offload.host_compute.decode_share import REFINE_EVERY

    banks = make_banks("bf16", 256, 160)
    share = HostDecodeShare(
        HostKernel(banks, torch.bfloat16, threads=1),
        (100_000, 150_000, 2_000, 30_000),
        max_tokens=4,
        top_k=2,
        num_experts=banks.num_experts,
        device="cpu",
    )
    _timed(share, 200_000 * (REFINE_EVERY - 1), REFINE_EVERY - 1, REFINE_EVERY - 1)
    assert not share.refine() and share.costs_ns[1] == 150_000  # too few experts yet
    # REFINE_EVERY experts, an eighth of them with a second token: the price beyond one token a pair (2 µs
    # each) is taken off before the per-expert price is read
    n = REFINE_EVERY
    _timed(share, 250_000 * n + 2_000 * (n // 8), n, n + n // 8)
    assert share.refine()
    assert share.costs_ns == (100_000, 200_000, 2_000, 30_000)
    assert share.costs.tolist() == [100_000, 200_000, 2_000, 30_000]  # what the graphs read
    assert share.report()["refinements"] == 1
    # the next window is counted from there: measured 200 µs again, the price stays
    _timed(share, 250_000 * n + 2_000 * (n // 8) + 200_000 * n, 2 * n, 2 * n + n // 8)
    assert share.refine() and share.costs_ns[1] == 200_000


def test_the_prefill_share_follows_the_refined_one_token_price():
    """The decode share's host nodes time the same kernel over the same banks the prefill's share computes
    with: each refinement hands its new one-token price on (boot wires it to HostShare.follow_host_price)."""
    from ferry.services.worker.offload.host_compute.decode_share import REFINE_EVERY
    from ferry.services.worker.offload.host_compute.prefill_share import HostCost, HostShare

    banks = make_banks("bf16", 256, 160)
    share = HostDecodeShare(
        HostKernel(banks, torch.bfloat16, threads=1),
        (100_000, 300_000, 2_000, 30_000),
        max_tokens=4,
        top_k=2,
        num_experts=banks.num_experts,
        device="cpu",
    )
    prefill = HostShare.__new__(HostShare)  # follow_host_price and split read only the cost
    prefill.cost = HostCost(pcie_s=100e-6, host_s_at_1=300e-6, host_s_per_token=2e-6, overhead_s=30e-6)
    share.on_refined = prefill.follow_host_price
    before = prefill.split(list(range(40)), tokens=4, top_k=2, num_experts=8)[1]
    _timed(share, 100_000 * REFINE_EVERY, REFINE_EVERY, REFINE_EVERY)  # the nodes took 100 µs an expert
    assert share.refine() and prefill.cost.host_s_at_1 == pytest.approx(200e-6)
    assert prefill.cost.host_s_per_token == 2e-6 and prefill.cost.pcie_s == 100e-6  # only the one-token price
    assert len(prefill.split(list(range(40)), tokens=4, top_k=2, num_experts=8)[1]) > len(before)


def test_a_window_of_many_tokens_an_expert_does_not_refine_the_one_token_price():
    from ferry.services.worker.offload.host_compute.decode_share import REFINE_EVERY

    banks = make_banks("bf16", 256, 160)
    share = HostDecodeShare(
        HostKernel(banks, torch.bfloat16, threads=1),
        (100_000, 150_000, 26_000, 30_000),
        max_tokens=4,
        top_k=2,
        num_experts=banks.num_experts,
        device="cpu",
    )
    n = REFINE_EVERY
    _timed(share, 160_000 * 3 * n, n, 3 * n)  # 8 streams: three tokens an expert
    assert not share.refine() and share.costs_ns[1] == 150_000
    _timed(share, 160_000 * 3 * n + 190_000 * n, 2 * n, 4 * n)  # then one stream: it moves, from there
    assert share.refine() and share.costs_ns[1] == 170_000


def test_no_refinement_without_timed_calls_or_where_the_costs_are_a_rule():
    banks = make_banks("bf16", 256, 160)
    share = HostDecodeShare(
        HostKernel(banks, torch.bfloat16, threads=1),
        (1, 0, 0, 0),
        max_tokens=4,
        top_k=2,
        num_experts=banks.num_experts,
        device="cpu",
    )
    share.refines = False  # --expert-backend cpu: every miss to the host
    _timed(share, 10**9, 4096, 4096)
    assert not share.refine() and share.costs_ns == (1, 0, 0, 0)
    share.refines = True
    _timed(share, 10**9, 8192, 8192)  # no time since the last window: nothing measured
    assert not share.refine() and share.refinements == 0


def test_autos_guard_prices_the_share_off_while_its_steps_are_longer_and_back_on_after(monkeypatch):
    """observe_step feeds the guard (share_guard.py); its choice is applied to the costs the graphs read:
    off, a host expert priced at OFF_PRICE_NS (the hand-off gives the host nothing, the prefetch copies
    everything) and no refinement; on again, the prices from before."""
    from ferry.kernels.expert_host_handoff import host_count_reference
    from ferry.services.worker.offload.host_compute.decode_share import OFF_PRICE_NS, REFINE_EVERY
    from ferry.services.worker.offload.host_compute.share_guard import ShareGuard

    banks = make_banks("bf16", 256, 160)
    costs = (100_000, 150_000, 2_000, 30_000)
    share = HostDecodeShare(
        HostKernel(banks, torch.bfloat16, threads=1),
        costs,
        max_tokens=4,
        top_k=2,
        num_experts=banks.num_experts,
        device="cpu",
    )
    share.observe_step(0.0, 1)  # no guard (hybrid asked for, or not auto): nothing happens
    assert share.costs_ns == costs and share.report()["guard"] is None
    share.guard = ShareGuard(window=8, samples=8, hold=60)
    now = 0.0
    for _ in range(50):  # steps with the share take 30 ms, without it 10 ms
        now += 0.030 if share.guard.share_on else 0.010
        share.observe_step(now, 1)
    assert not share.guard.share_on and not share.guard.exploring
    assert share.costs_ns == (100_000, OFF_PRICE_NS, 2_000, 30_000) and share.costs.tolist()[1] == OFF_PRICE_NS
    assert host_count_reference(8, 8, share.costs_ns) == 0  # the hand-off's rule: nothing for the host
    _timed(share, 999_000 * REFINE_EVERY, REFINE_EVERY, REFINE_EVERY)
    assert not share.refine() and share.costs_ns[1] == OFF_PRICE_NS  # off: no price to refine
    report = share.report()["guard"]
    assert report["share_on"] is False and report["decisions"][-1]["share_on"] is False
    for _ in range(120):  # the hold ends: it explores again, and now the share wins
        now += 0.007 if share.guard.share_on else 0.010
        share.observe_step(now, 1)
    assert share.guard.share_on and share.costs_ns == costs


def test_the_guards_scale_prices_a_host_expert_and_the_price_under_it_is_refined():
    """A climb of auto's guard (share_guard.py) to the scale whose steps are shortest: the hand-off then
    reads the host's one-token price times that scale; refinement moves the price itself, the scale
    still applied over it; the report and its prices say both."""
    from ferry.kernels.expert_host_handoff import host_count_reference
    from ferry.services.worker.offload.host_compute.decode_share import REFINE_EVERY
    from ferry.services.worker.offload.host_compute.share_guard import ShareGuard

    banks = make_banks("bf16", 256, 160)
    costs = (100_000, 150_000, 2_000, 30_000)
    share = HostDecodeShare(
        HostKernel(banks, torch.bfloat16, threads=1),
        costs,
        max_tokens=4,
        top_k=2,
        num_experts=banks.num_experts,
        device="cpu",
    )
    share.guard = ShareGuard(window=8, samples=8, hold=10**6)
    now = 0.0
    for _ in range(800):  # off 20 ms; on, 10 ms at a scale of 0.64 and 1 ms more a 0.1 away from it
        scale = share.guard.scale
        now += 0.020 if scale is None else 0.010 + 0.01 * abs(scale - 0.64)
        share.observe_step(now, 1)
    assert share.guard.scale == 0.64 and not share.guard.exploring
    assert share.costs_ns == (100_000, 96_000, 2_000, 30_000) and share.costs.tolist() == [
        100_000,
        96_000,
        2_000,
        30_000,
    ]
    # a cheaper host: of 6 one-token misses the hand-off's rule gives it more than at the price itself
    assert host_count_reference(6, 6, share.costs_ns) > host_count_reference(6, 6, costs)
    report = share.report()
    assert report["price_ns"] == list(costs) and report["guard"]["scale"] == 0.64
    _timed(share, 250_000 * REFINE_EVERY, REFINE_EVERY, REFINE_EVERY)  # the nodes took 250 µs an expert
    assert share.refine()
    assert share.report()["price_ns"][1] == 200_000 and share.costs_ns[1] == 128_000  # half way, then scaled


def test_a_scale_leaves_the_cpu_backends_zero_price_at_zero():
    """--expert-backend cpu prices a host expert at 0 (every miss to the host): a guard's scale, were one
    ever applied over it, keeps that rule rather than making the price 1 ns."""
    banks = make_banks("bf16", 256, 160)
    share = HostDecodeShare(
        HostKernel(banks, torch.bfloat16, threads=1),
        (100_000, 0, 0, 30_000),
        max_tokens=4,
        top_k=2,
        num_experts=banks.num_experts,
        device="cpu",
    )
    share._scale = 0.64
    share._apply()
    assert share.costs_ns == (100_000, 0, 0, 30_000) and share.costs.tolist() == [100_000, 0, 0, 30_000]


def _affinity_after_node(*shares: HostDecodeShare, layer: int = 0) -> set[int]:
    """Run layer `layer`'s node of each share on one thread of its own, as CUDA's driver runs them; that
    thread's CPUs after."""
    import os
    import threading

    seen = {}

    def node():
        for share in shares:
            share.kernel.lib.ferry_host_node(ctypes.addressof(share.tasks[layer]))
        seen["cpus"] = os.sched_getaffinity(0)  # 0: the calling thread

    thread = threading.Thread(target=node)
    thread.start()
    thread.join()
    return seen["cpus"]


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="thread affinity is Linux's")
def test_the_thread_that_runs_the_nodes_takes_the_callers_cpu_where_asked():
    import os

    allowed = sorted(os.sched_getaffinity(0))
    banks = make_banks("bf16", 256, 160)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    pairs = [(0, 4, 0.25), (1, 1, 0.5)]
    want = HostKernel(banks, torch.bfloat16, threads=1).compute(0, x, pairs)

    def share_on(cpus: list[int]) -> HostDecodeShare:
        kernel = HostKernel(banks, torch.bfloat16, threads=2, cpus=cpus)
        share = HostDecodeShare(
            kernel, (1, 1, 0, 0), max_tokens=4, top_k=2, num_experts=banks.num_experts, device="cpu"
        )
        p = share.pinned
        for i, (t, e, w) in enumerate(pairs):
            p.pair_token[i], p.pair_expert[i], p.pair_weight[i] = t, e, w
        p.meta[0], p.meta[1] = 2, len(pairs)
        share._x[:2] = x
        return share

    # on CPU the nodes run on the caller's own thread, which is never pinned (the tests', the worker's)
    share = share_on([allowed[-1]])
    assert share.tasks[0].pin_caller == 0
    assert _affinity_after_node(share) == set(allowed) and share.kernel.caller_pinned == 0
    # as on CUDA: the driver's thread takes cpus[0], once, and computes the same
    for task in share.tasks:
        task.pin_caller = 1
    assert _affinity_after_node(share) == {allowed[-1]} and share.kernel.caller_pinned == 1
    assert torch.equal(share._out[:2], want)
    assert os.sched_getaffinity(0) == set(allowed)  # this thread untouched
    if len(allowed) > 1:  # the list's first CPU, not another of it (the workers take the rest)
        first = share_on([allowed[0], allowed[-1]])
        first.tasks[0].pin_caller = 1
        assert _affinity_after_node(first) == {allowed[0]} and first.kernel.caller_pinned == 1
        assert torch.equal(first._out[:2], want)
    # a thread that runs a second pool's nodes on the same CPU: asked once, both pools say pinned
    other = share_on([allowed[-1]])
    other.tasks[0].pin_caller = 1
    assert _affinity_after_node(share, other) == {allowed[-1]} and other.kernel.caller_pinned == 1
    # a CPU the process may not run on: refused (EINVAL), the thread runs where it was and computes the same
    refused = share_on([max(allowed) + 4096])
    refused.tasks[0].pin_caller = 1
    assert _affinity_after_node(refused) == set(allowed) and refused.kernel.caller_pinned == 22
    assert torch.equal(refused._out[:2], want)
    refused.check()
    # no CPUs at all: nothing to take
    free = share_on([])
    free.tasks[0].pin_caller = 1
    assert _affinity_after_node(free) == set(allowed) and free.kernel.caller_pinned == 0
