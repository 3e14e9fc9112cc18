"""bench/decode_suite.py's issue-25 record: the host-share run against GPU-only from the same suite run,
with the bound of both paths read from the worker's boot line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.decode_suite import logged_event, write_hybrid_cpu

BOOT = (
    "2026-12-01 10:00:00 [info     ] host_decode                    handoff_us=31.2 host_us_at_1=148.0 "
    "max_tokens=8 pcie_us=129.0\n"
)


def test_the_record_holds_both_runs_and_the_bound_of_both_paths(tmp_path):
    (tmp_path / "serve_12layer_host-share.log").write_text("2026-12-01 [info ] plan budget_bytes=1\n" + BOOT)
    (tmp_path / "serve_12layer.log").write_text(BOOT)  # the default variant (auto) logs to the workload's name
    assert logged_event(tmp_path / "serve_12layer_host-share.log", "host_decode")["pcie_us"] == "129.0"
    gpu = {
        "single_stream_tok_s": 97.9,
        "streams8_tok_s": 200.0,
        "single_stream_bound_tok_s": 108.0,
        "commit": "a",
        "hit_rate": 0.5,
    }
    hybrid = {"single_stream_tok_s": 150.0, "streams8_tok_s": 210.0, "commit": "b", "hit_rate": 0.4}
    got = write_hybrid_cpu("12layer", "host-share", gpu, hybrid, tmp_path)
    assert got == json.loads((tmp_path / "decode_12layer_hybrid_cpu.json").read_text())
    assert got["gpu_only_single_stream_tok_s"] == 97.9 and got["single_stream_tok_s"] == 150.0
    assert got["single_stream_speedup"] == round(150.0 / 97.9, 3) and got["commit"] == "b"
    # the link carries an expert in 129 µs, the host computes one in 148: together 1 + 129/148 times the link
    assert got["bound_tok_s"] == round(108.0 * (1 + 129.0 / 148.0), 2)
    auto = write_hybrid_cpu("12layer", "default", gpu, hybrid, tmp_path)
    assert auto["bound_tok_s"] == got["bound_tok_s"] and (tmp_path / "decode_12layer_default_hybrid_cpu.json").is_file()


def test_without_the_boot_line_there_is_no_bound_rather_than_a_made_up_one(tmp_path):
    gpu = {
        "single_stream_tok_s": 97.9,
        "streams8_tok_s": 200.0,
        "single_stream_bound_tok_s": 108.0,
        "commit": "a",
        "hit_rate": 0.5,
    }
    hybrid = {"single_stream_tok_s": 99.0, "streams8_tok_s": 190.0, "commit": "b", "hit_rate": 0.5}
    got = write_hybrid_cpu("hybrid8", "host-share-no-prefetch", gpu, hybrid, tmp_path)
    assert got["bound_tok_s"] is None and got["bound_fraction"] is None
    assert (tmp_path / "decode_hybrid8_no-prefetch_hybrid_cpu.json").is_file()


def test_the_boot_line_is_read_from_the_workers_json_log(tmp_path):
    """The worker logs JSON lines when its stderr is not a terminal (a suite run): the bound comes from them."""
    line = {"pcie_us": 171.8, "host_us_at_1": 118.3, "handoff_us": 55.8, "event": "host_decode", "process": "worker"}
    off = {"event": "host_decode_off", "reason": "auto", "pcie_us": 1.0}
    (tmp_path / "serve_12layer_host-share.log").write_text(json.dumps(off) + "\n{not json\n" + json.dumps(line) + "\n")
    assert logged_event(tmp_path / "serve_12layer_host-share.log", "host_decode")["pcie_us"] == 171.8
    gpu = {
        "single_stream_tok_s": 99.9,
        "streams8_tok_s": 118.0,
        "single_stream_bound_tok_s": 107.2,
        "commit": "a",
        "hit_rate": 0.9,
    }
    got = write_hybrid_cpu("12layer", "host-share", gpu, {**gpu, "commit": "b"}, tmp_path)
    assert got["bound_tok_s"] == round(107.2 * (1 + 171.8 / 118.3), 2)


def test_the_host_shares_series_are_read_from_the_workers_metrics():
    """host_share_series parses what the worker exports (services/worker/metrics.py), over HTTP."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import generate_latest

    from bench.decode_suite import host_share_series
    from ferry.services.worker.metrics import WorkerMetrics

    report = {
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
        "host_decode": {
            "experts": 4000,
            "pairs": 4100,
            "costs_ns": [129000, 150000, 2500, 31000],
            "busy_ns": 800_000_000,
            "busy_calls": 900,
            "busy_ns_per_expert": 200000,
            "busy_hist": {"bounds_s": [50e-6, 100e-6], "counts": [100, 700, 100]},
            "refinements": 1,
            "guard": {"share_on": True, "scale": 0.8, "exploring": False, "decisions": []},
        },
    }
    metrics = WorkerMetrics()
    metrics.watch_expert_cache(lambda: report)
    body = generate_latest(metrics.registry)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = host_share_series(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
    assert got == {
        "experts": 4000,
        "host_node_busy_s": 0.8,
        "host_node_calls": 900,
        "refinements": 1,
        "host_at_1_s": 0.00015,
        "host_node_s_per_expert": 0.0002,
        "guard_price_scale": 0.8,
        "host_node_calls_le": {"5e-05": 100, "0.0001": 800, "+Inf": 900},
    }
    assert host_share_series(None) is None


def test_the_bound_takes_the_host_expert_its_host_nodes_timed_in_the_run(tmp_path):
    (tmp_path / "serve_12layer_host-share.log").write_text(BOOT)
    gpu = {
        "single_stream_tok_s": 97.9,
        "streams8_tok_s": 200.0,
        "single_stream_bound_tok_s": 108.0,
        "commit": "a",
        "hit_rate": 0.5,
    }
    hybrid = {
        "single_stream_tok_s": 150.0,
        "streams8_tok_s": 210.0,
        "commit": "b",
        "hit_rate": 0.4,
        "host_share": {"host_node_s_per_expert": 0.000129},
    }
    got = write_hybrid_cpu("12layer", "host-share", gpu, hybrid, tmp_path)
    assert got["bound_tok_s"] == round(108.0 * 2, 2) and got["bound_host_us_per_expert"] == 129.0
    assert got["host_share"] == {"host_node_s_per_expert": 0.000129}


def test_the_host_nodes_window_is_the_difference_of_two_readings():
    from bench.profile_serve import host_nodes_window

    before = {"host_node_calls": 100, "host_node_busy_s": 0.02, "host_node_calls_le": {"5e-05": 10, "+Inf": 100}}
    after = {"host_node_calls": 300, "host_node_busy_s": 0.07, "host_node_calls_le": {"5e-05": 30, "+Inf": 300}}
    assert host_nodes_window(before, after) == {"calls": 200, "mean_us": 250.0, "calls_le": {"5e-05": 20, "+Inf": 200}}
    assert host_nodes_window(before, before)["mean_us"] is None


def test_a_variant_with_its_own_environment_starts_its_server_with_it(tmp_path, monkeypatch):
    """`spin1000` is auto with FERRY_HOST_POOL_SPIN_US=1000 (VARIANT_ENV): its server gets the variable on top of
    this process's environment, the recorded command shows it, and its record is named after the variant."""
    import os

    import bench.serve_process as serve_process
    from bench.decode_suite import VARIANT_ENV, VARIANTS

    seen = {}

    class FakePopen:
        def __init__(self, cmd, **kwargs):
            seen.update(cmd=cmd, env=kwargs.get("env"))

    monkeypatch.setattr(serve_process.subprocess, "Popen", FakePopen)
    served = serve_process.start_serve(
        tmp_path / "m",
        ["--load-format", "dummy", *VARIANTS["spin1000"]],
        tmp_path / "serve.log",
        env=VARIANT_ENV["spin1000"],
    )
    assert seen["env"]["FERRY_HOST_POOL_SPIN_US"] == "1000" and seen["env"]["PATH"] == os.environ["PATH"]
    assert served.command.startswith("FERRY_HOST_POOL_SPIN_US=1000 ferry serve --model")
    serve_process.start_serve(tmp_path / "m", [], tmp_path / "serve2.log")
    assert seen["env"] is None  # no variables of its own: this process's environment, as before
    served.log.close()
    # the suite hands each variant's variables to its server (and none to a variant without them)
    import bench.decode_suite as suite

    class Stop(Exception):
        pass

    class Served:
        command = "ferry serve"

        def wait_ready(self, timeout):
            raise Stop

        def stop(self):
            return None

    asked = []
    monkeypatch.setattr(suite, "make_bench_model", lambda out, *a, **k: out)
    monkeypatch.setattr(suite, "start_serve", lambda model, args, log, env=None: asked.append(env) or Served())
    for variant in ("spin1000", "default"):
        with pytest.raises(Stop):
            suite.run_workload(
                "hybrid8", variant, tmp_path, tmp_path / "ceilings.json", SimpleNamespace(ready_timeout=1)
            )
    assert asked == [{"FERRY_HOST_POOL_SPIN_US": "1000"}, None]
    (tmp_path / "serve_hybrid8_spin1000.log").write_text(BOOT)
    gpu = {
        "single_stream_tok_s": 201.0,
        "streams8_tok_s": 240.0,
        "single_stream_bound_tok_s": 195.0,
        "commit": "a",
        "hit_rate": 0.9,
    }
    got = write_hybrid_cpu("hybrid8", "spin1000", gpu, {**gpu, "single_stream_tok_s": 258.0, "commit": "b"}, tmp_path)
    assert got["single_stream_speedup"] == round(258.0 / 201.0, 3) and got["bound_tok_s"] is not None
    assert (tmp_path / "decode_hybrid8_spin1000_hybrid_cpu.json").is_file()


def test_a_gguf_workload_is_written_with_its_blocks_and_served_as_read(tmp_path, monkeypatch):
    """A GGUF workload's bench model is the file of random blocks (make-bench-model --weights random), served
    without --load-format dummy; every other workload is a config served with dummy weights."""
    import bench.serve_process as sp
    from bench.decode_suite import workload_model

    ran = []
    monkeypatch.setattr(sp.subprocess, "run", lambda cmd, **kw: ran.append(cmd))
    model, flags, fmt = workload_model("hybrid8_q4km", tmp_path / "g")
    assert fmt == "gguf-q4_k_m" and "--load-format" not in flags and "--moe-cache-size" in flags
    assert ran[0][ran[0].index("--format") + 1] == "gguf-q4_k_m" and "--weights" in ran[0]
    model, flags, fmt = workload_model("hybrid8_nvfp4", tmp_path / "n")
    assert fmt == "nvfp4" and flags[:2] == ["--load-format", "dummy"] and "--weights" not in ran[1]
