"""The host kernel's thread pool (kernels/host_experts_c/thread_pool.c), built here from its source with a
small C driver (thread_pool_stress.c) and run over tens of thousands of calls back to back: every item runs
once, on its own call's arguments and a worker index of its own, phase 1 after phase 0, none after its
call returned. The build yields the core at the protocol's race points (FERRY_POOL_RACE_POINT: between a
worker's look at the ticket and its claim, between the caller's setting up of a call and its
publishing), so that the races show on any machine, not only one with fewer cores than threads: the
first form of the pool's ticket (counting up to a separate total) fails it at once, items running twice
after an empty call. Where the compiler has ThreadSanitizer, the driver runs under it too and must report
no data race. The kernel's own results are held across thread counts in test_host_expert_kernel.py.

The runs are bounded by work, not seconds: on a loaded machine 9 threads on 2 cores may take minutes, so
a run fails only where it stops making progress (no thousand calls done in STALL_S: a hung pool)."""

from __future__ import annotations

import select
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
POOL = ROOT / "kernels" / "host_experts_c"
DRIVER = Path(__file__).with_name("thread_pool_stress.c")
CC = shutil.which("cc") or shutil.which("gcc")

needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")
STALL_S = 240  # no progress line for this long: the pool hangs (a slow machine still prints one every few seconds)


def run_until_done(exe: Path, threads: int, calls: int) -> tuple[list[str], str]:
    """The driver's stdout lines and its stderr once it exits; fails the test if it stalls for STALL_S."""
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: ThreadSanitizer's reports could fill one
        proc = subprocess.Popen([str(exe), str(threads), str(calls)], stdout=subprocess.PIPE, stderr=err, text=True)
        lines = []
        try:
            while True:
                ready, _, _ = select.select([proc.stdout], [], [], STALL_S)
                if not ready:
                    pytest.fail(f"no progress in {STALL_S} s after {lines[-1] if lines else 0} calls: the pool hangs")
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line.strip())
            code = proc.wait()
        finally:
            proc.kill()
            proc.wait()
        err.seek(0)
        return lines + ([] if code == 0 else [f"exit status {code}"]), err.read()


def build(tmp_path: Path, *flags: str) -> Path | None:
    exe = tmp_path / "thread_pool_stress"
    cmd = [CC, "-std=gnu11", "-pthread", *flags, f"-I{POOL}", str(DRIVER), str(POOL / "thread_pool.c"), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return None if "-fsanitize=thread" in flags else pytest.fail(done.stderr)
    return exe


@pytest.fixture(scope="module")
def stress_exe(tmp_path_factory) -> Path:
    """The driver built once with the race points yielding, for every thread count."""
    return build(tmp_path_factory.mktemp("stress"), "-O2", "-DFERRY_POOL_RACE_POINT()=sched_yield()")


@needs_cc
@pytest.mark.slow
@pytest.mark.timeout(0)  # bounded by progress (run_until_done), not by the suite's per-test seconds
# Calls by the workers' call-encounters (workers x calls), the 2-thread run's 100 000 the unit: 3 threads' 2 workers
# meet as many in 50 000 calls (1,562 large ones), 9 threads' 8 workers in 12 500 (390 large ones). More would only
# repeat them, each call costing more where more spinning threads than cores take turns with the caller (tenfold
# for 9 threads on a 2-core runner: 25 000 of them took 57 s in a loaded suite)
@pytest.mark.parametrize("threads, calls", [(2, 100_000), (3, 50_000), (9, 12_500)])
def test_every_item_runs_once_on_its_own_call(stress_exe, threads, calls):
    lines, err = run_until_done(stress_exe, threads, calls)
    assert lines[-1:] == ["ok"] and len(lines) == calls // 1000 + 1, lines[-3:] + [err]


@needs_cc
@pytest.mark.timeout(0)  # bounded by progress (run_until_done)
def test_no_data_race_under_thread_sanitizer(tmp_path):
    exe = build(tmp_path, "-O1", "-g", "-fsanitize=thread")
    if exe is None:
        pytest.skip("this compiler has no ThreadSanitizer")
    probe = subprocess.run([str(exe), "1", "1"], capture_output=True, text=True, timeout=60)
    if "ThreadSanitizer" in probe.stderr and probe.returncode != 0 and "ok" not in probe.stdout:
        pytest.skip(f"ThreadSanitizer cannot run here: {probe.stderr.strip()[:200]}")
    lines, err = run_until_done(exe, 5, 30_000)
    assert lines[-1:] == ["ok"], lines[-3:]
    assert "WARNING: ThreadSanitizer" not in err, err[-3000:]
