"""Kernels compiled once the worker is ready (services/worker/compile_watch.py): each is logged with its kernel
and seconds and counted in /metrics, through Triton's own compile hooks, which are installed only where free."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from structlog.testing import capture_logs

from ferry.services.worker.compile_watch import CompileWatch
from ferry.services.worker.metrics import WorkerMetrics


def test_a_compile_is_logged_with_its_kernel_and_seconds_and_counted():
    now = [100.0]
    watch = CompileWatch(clock=lambda: now[0])
    with capture_logs() as logs:
        assert watch.before_compile(key=("k1",), repr="_fused_rms[num_warps=4](x: *bf16)") is False  # compile goes on
        now[0] += 2.5
        watch.after_compile(key=("k1",), repr="_fused_rms[num_warps=4](x: *bf16)")
    assert watch.report() == {"compiles": 1, "seconds": 2.5}
    assert logs[0]["event"] == "kernel_compiled_in_service" and logs[0]["kernel"] == "_fused_rms"
    assert logs[0]["seconds"] == 2.5 and logs[0]["log_level"] == "warning"
    metrics = WorkerMetrics()
    metrics.watch_compiles(watch.report)
    text = generate_latest(metrics.registry).decode()
    assert "ferry_worker_kernel_compiles_total 1.0" in text
    assert "ferry_worker_kernel_compile_seconds_total 2.5" in text


def test_it_hooks_tritons_compiles_only_where_no_one_else_has():
    knobs = pytest.importorskip("triton").knobs
    runtime = knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    try:
        runtime.jit_cache_hook = runtime.jit_post_compile_hook = None
        watch = CompileWatch()
        assert watch.install() and watch.installed
        assert runtime.jit_cache_hook == watch.before_compile and runtime.jit_post_compile_hook == watch.after_compile
        assert not CompileWatch().install()  # hooks already set (a profiler's, another watch's): left alone
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved
