"""The host's share of a streamed prefill's missed experts: how many a layer gives the host (HostCost),
which ones (HostShare.split). The computation itself is checked against the all-resident store in
interpreted_offload_store.py (check_host_share)."""

from __future__ import annotations

from ferry.services.worker.offload.host_compute.prefill_share import HostCost


def test_equal_costs_split_the_missed_experts_in_half():
    assert HostCost(1.0, 1.0, 0.0, 0.0).host_count(10, 1) == 5
    assert (
        HostCost(1.0, 1.0, 0.0, 0.0).host_count(11, 1) == 5
    )  # rounded down: the link's side is never the longer by more


def test_the_split_is_the_shortest_layer_of_every_possible_one():
    """The balance point rounded down or up, whichever layer is shorter, is the best of every split: checked
    against all of them, for the prefill's float costs and the decode kernels' integer ones."""
    import random

    from ferry.kernels.expert_host_handoff import host_count_reference

    rng = random.Random(5)
    for _ in range(2000):
        pcie, at_1, per_token, overhead = (
            rng.randint(1, 400),
            rng.randint(1, 400),
            rng.randint(0, 30),
            rng.randint(0, 1500),
        )
        missed, per_expert = rng.randint(0, 40), rng.randint(1, 12)
        host = at_1 + per_token * (per_expert - 1)

        def layer(n: int) -> int:
            return max((missed - n) * pcie, overhead + n * host) if n else missed * pcie

        best = min(range(missed + 1), key=layer)  # the smallest n of the shortest layer
        got = host_count_reference(missed, missed * per_expert, (pcie, at_1, per_token, overhead))
        assert layer(got) == layer(best) and (got == 0 or got <= best), (pcie, at_1, per_token, overhead, missed)
        cost = HostCost(pcie * 1e-6, at_1 * 1e-6, per_token * 1e-6, overhead * 1e-6)
        assert abs(layer(cost.host_count(missed, per_expert)) - layer(best)) <= 1e-9 * max(layer(best), 1)


def test_the_h200_figures_give_the_host_a_third_of_a_short_prefills_misses():
    """A packed Qwen3-30B expert (7.08 MB): 129 us over 55 GB/s, 148 us on 15 host threads at one token,
    ~10 us more a token (9.4 MFLOP a token); 9 tokens an expert, 205 missed."""
    cost = HostCost(pcie_s=129e-6, host_s_at_1=148e-6, host_s_per_token=10e-6, overhead_s=50e-6)
    h = cost.host_count(205, 9)
    assert h == 74  # 131 copies end at 16.90 ms, the host's 74 at 16.92 (73: 17.03 ms on the link's side)
    layer = max((205 - h) * cost.pcie_s, cost.overhead_s + h * cost.host_s(9))
    assert layer < 0.65 * 205 * cost.pcie_s  # the pass takes under two thirds of the link's time alone


def test_a_long_prefills_share_falls_to_nothing():
    """At hundreds of tokens an expert the host is compute bound: a few experts at 256 tokens (the host's 2.7 ms
    each against the link's 0.13), none at 4096."""
    cost = HostCost(pcie_s=129e-6, host_s_at_1=148e-6, host_s_per_token=10e-6, overhead_s=50e-6)
    assert 0 < cost.host_count(205, 256) <= 0.05 * 205
    assert cost.host_count(205, 4096) == 0


def test_beyond_the_sizes_the_costs_were_measured_at_the_host_takes_nothing():
    """The calibration times a 512-token hand-off and the kernel at 1 and 16 tokens an expert. On the H200 a
    share priced from those at 1,200-token and 8,192-token steps made them 1.2-3.3x slower:
    beyond either size the host takes nothing, within them the rule is as before."""
    measured = HostCost(
        pcie_s=129e-6,
        host_s_at_1=148e-6,
        host_s_per_token=10e-6,
        overhead_s=50e-6,
        max_step_tokens=512,
        max_tokens_per_expert=16,
    )
    assert measured.host_count(205, 9, step_tokens=288) == 74  # as the unbounded rule gives (the test above)
    assert measured.host_count(205, 9, step_tokens=513) == 0  # a step larger than the hand-off timed
    assert measured.host_count(205, 37, step_tokens=500) == 0  # more tokens an expert than the kernel timed
    assert measured.host_count(205, 16, step_tokens=512) > 0  # the edges themselves were measured
    rule = HostCost(1.0, 0.0, 0.0, 0.0)  # cpu's rule: every miss to the host, at any size
    assert rule.host_count(205, 256, step_tokens=8192) == 205


def test_the_step_size_reaches_the_rule_through_split():
    from ferry.services.worker.offload.host_compute.prefill_share import HostShare

    share = HostShare.__new__(HostShare)  # split reads only the cost
    share.cost = HostCost(1.0, 1.0, 0.0, 0.0, max_step_tokens=4)
    assert share.split([3, 5, 8, 9], tokens=4, top_k=2, num_experts=8) == ([3, 5], [8, 9])
    assert share.split([3, 5, 8, 9], tokens=5, top_k=2, num_experts=8) == ([3, 5, 8, 9], [])


def test_nothing_to_share_or_a_hand_off_dearer_than_the_saving_gives_the_host_nothing():
    assert HostCost(1.0, 1.0, 0.0, 0.0).host_count(0, 1) == 0
    assert HostCost(1e-4, 1e-4, 0.0, 1e-2).host_count(20, 1) == 0  # 10 ms of hand-off against 2 ms of copies


def test_split_gives_the_host_the_tail_of_the_layers_list():
    from ferry.services.worker.offload.host_compute.prefill_share import HostShare

    share = HostShare.__new__(HostShare)  # split reads only the cost
    share.cost = HostCost(1.0, 1.0, 0.0, 0.0)
    assert share.split([3, 5, 8, 9], tokens=4, top_k=2, num_experts=8) == ([3, 5], [8, 9])


def test_calibration_runs_on_the_stores_own_paths():
    """On CPU the figures mean nothing, but every measurement runs: the ring's copy, the host's computation
    at 1 and 16 tokens, the hand-off; the host's time grows with its tokens."""
    import torch
    from offload_tiny import slot_pool, tiny_spec

    from ferry.services.worker.offload.host_compute.host_experts import HostExperts
    from ferry.services.worker.offload.host_compute.prefill_share import calibrate
    from ferry.services.worker.offload.host_memory.host_banks import HostBanks
    from ferry.services.worker.offload.slot_cache.frequency_policy import LFUExpertPolicy
    from ferry.services.worker.offload.stores.device_driven import DeviceDrivenExperts

    spec = tiny_spec(layers=2, experts=6, top_k=2, hidden=256, inter=128)
    banks = HostBanks.for_model(spec, "float32", progress=False)
    store = DeviceDrivenExperts(slot_pool(spec, 7, max_step_tokens=48), banks, LFUExpertPolicy(2, 6, 7), "cpu")
    cost = calibrate(
        store, HostExperts(banks, torch.float32, threads=1), torch.device("cpu"), probe_experts=4, repeats=3
    )
    assert cost.pcie_s > 0 and cost.host_s_at_1 > 0 and cost.overhead_s > 0
    assert cost.host_s(16) >= cost.host_s(1)
    assert (cost.max_step_tokens, cost.max_tokens_per_expert) == (512, 16)  # what it timed bounds the split


def test_each_timed_call_of_the_calibration_reads_experts_no_earlier_call_read():
    """The calibration times host RAM, not what the call before left in the CPU's caches: while the model
    has enough experts, the probes of successive calls never repeat a (layer, expert); past that they wrap
    and stay in range."""
    from ferry.services.worker.offload.host_compute.prefill_share import probe

    layers, experts, n = 48, 128, 8
    calls = layers * experts // n
    seen = [(layer, e) for c in range(calls) for layer, ids in [probe(c, n, layers, experts)] for e in ids]
    assert len(set(seen)) == len(seen) == layers * experts
    small = [probe(c, 4, 2, 6) for c in range(12)]
    assert all(0 <= layer < 2 and len(set(ids)) == 4 and all(0 <= e < 6 for e in ids) for layer, ids in small)
    assert len({(layer, tuple(ids)) for layer, ids in small[:3]}) == 3
