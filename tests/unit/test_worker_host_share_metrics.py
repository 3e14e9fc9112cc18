"""The worker's /metrics name what the host's share of missed experts computed and the costs it splits by."""

from __future__ import annotations

from prometheus_client import generate_latest

from ferry.services.worker.metrics import WorkerMetrics

REPORT = {
    "hits": 5,
    "misses": 7,
    "bytes_copied": 10,
    "copy_time_s": 0.1,
    "exposed_copy_time_s": 0.05,
    "prefetched": 2,
    "prefetch_useful": 1,
    "prefetch_wasted": 1,
    "slots": 12,
    "expert_format": "bf16",
}


def scrape(report: dict) -> str:
    m = WorkerMetrics()
    m.watch_expert_cache(lambda: report)
    return generate_latest(m.registry).decode()


def test_the_host_shares_experts_and_costs_are_exported():
    text = scrape(
        {
            **REPORT,
            "host_share": {"layers": 3, "experts": 40, "costs_ns": [129000, 148000, 2500, 751000]},
            "host_decode": {"experts": 9, "pairs": 11, "costs_ns": [129000, 148000, 2500, 31000]},
        }
    )
    assert 'ferry_worker_host_experts_total{share="prefill"} 40.0' in text
    assert 'ferry_worker_host_experts_total{share="decode"} 9.0' in text
    assert 'ferry_worker_host_share_cost_seconds{path="handoff",share="decode"} 3.1e-05' in text
    assert 'ferry_worker_host_share_cost_seconds{path="pcie",share="prefill"} 0.000129' in text


def test_the_host_nodes_time_and_the_refinements_are_exported():
    decode = {
        "experts": 9,
        "pairs": 11,
        "costs_ns": [1, 2, 3, 4],
        "busy_ns": 1_500_000_000,
        "busy_calls": 7,
        "busy_ns_per_expert": 166_666_667,
        "refinements": 2,
    }
    text = scrape({**REPORT, "host_decode": decode})
    assert "ferry_worker_host_node_busy_seconds_total 1.5" in text
    assert "ferry_worker_host_node_calls_total 7.0" in text
    assert "ferry_worker_host_share_refinements_total 2.0" in text
    assert "ferry_worker_host_decode_share_on" not in text  # no guard: hybrid asked for


def test_the_host_nodes_calls_are_exported_by_wall_time():
    decode = {
        "experts": 9,
        "pairs": 11,
        "costs_ns": [1, 2, 3, 4],
        "busy_ns": 900_000,
        "busy_calls": 6,
        "busy_ns_per_expert": 100_000,
        "refinements": 0,
        "busy_hist": {"bounds_s": [50e-6, 100e-6, 200e-6], "counts": [1, 0, 3, 2]},
    }
    text = scrape({**REPORT, "host_decode": decode})
    assert 'ferry_worker_host_node_call_seconds_bucket{le="5e-05"} 1.0' in text
    assert 'ferry_worker_host_node_call_seconds_bucket{le="0.0002"} 4.0' in text  # cumulative
    assert 'ferry_worker_host_node_call_seconds_bucket{le="+Inf"} 6.0' in text
    assert "ferry_worker_host_node_call_seconds_count 6.0" in text
    assert "ferry_worker_host_node_call_seconds_sum 0.0009" in text


def test_autos_guard_says_whether_the_decode_share_is_on():
    decode = {
        "experts": 9,
        "pairs": 11,
        "costs_ns": [1, 2, 3, 4],
        "busy_ns": 1,
        "busy_calls": 1,
        "busy_ns_per_expert": 1,
        "refinements": 0,
    }
    for scale in (0.64, None):
        guard = {"share_on": scale is not None, "scale": scale, "exploring": False, "decisions": []}
        text = scrape({**REPORT, "host_decode": {**decode, "guard": guard}})
        assert f"ferry_worker_host_decode_share_on {0.0 if scale is None else 1.0}" in text
        assert f"ferry_worker_host_decode_price_scale {scale or 0.0}" in text


def test_how_decode_layers_reach_the_host_is_exported():
    decode = {
        "experts": 9,
        "pairs": 11,
        "costs_ns": [1, 2, 3, 4],
        "busy_ns": 1,
        "busy_calls": 1,
        "busy_ns_per_expert": 1,
        "refinements": 0,
    }
    for handoff, layers in (("poll", 480), ("node", 0)):
        text = scrape({**REPORT, "host_decode": {**decode, "handoff": handoff, "polled_layers": layers}})
        assert f"ferry_worker_host_decode_polled {1.0 if handoff == 'poll' else 0.0}" in text
        assert f"ferry_worker_host_decode_polled_layers_total {float(layers)}" in text
    assert "ferry_worker_host_decode_polled" not in scrape({**REPORT, "host_decode": decode})
    covered = {**decode, "handoff": "node", "polled_layers": 0, "min_tokens": 2}
    assert "ferry_worker_host_decode_min_tokens 2.0" in scrape({**REPORT, "host_decode": covered})


def test_without_a_host_share_there_is_no_host_series():
    assert "ferry_worker_host" not in scrape(REPORT)
