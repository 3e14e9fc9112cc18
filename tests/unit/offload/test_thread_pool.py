"""The host kernel's thread pool (kernels/host_experts_c/thread_pool.c), built here from its source with a
small C driver (thread_pool_stress.c) and run over a hundred thousand calls back to back: every item runs
once, on its own call's arguments and a worker index of its own, phase 1 after phase 0, none after its
call returned. The build yields the core at the protocol's race points (FERRY_POOL_RACE_POINT: between a
worker's look at the ticket and its claim, between the caller's setting up of a call and its
publishing), so that the races show on any machine, not only one with fewer cores than threads: the
first form of the pool's ticket (counting up to a separate total) fails it at once, items running twice
after an empty call. Where the compiler has ThreadSanitizer, the driver runs under it too and must report
no data race. The kernel's own results are held across thread counts in test_host_expert_kernel.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
POOL = ROOT / "kernels" / "host_experts_c"
DRIVER = Path(__file__).with_name("thread_pool_stress.c")
CC = shutil.which("cc") or shutil.which("gcc")

needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")


def build(tmp_path: Path, *flags: str) -> Path | None:
    exe = tmp_path / "thread_pool_stress"
    cmd = [CC, "-std=gnu11", "-pthread", *flags, f"-I{POOL}", str(DRIVER), str(POOL / "thread_pool.c"), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return None if "-fsanitize=thread" in flags else pytest.fail(done.stderr)
    return exe


@needs_cc
@pytest.mark.parametrize("threads", [2, 3, 9])
def test_every_item_runs_once_on_its_own_call(tmp_path, threads):
    exe = build(tmp_path, "-O2", "-DFERRY_POOL_RACE_POINT()=sched_yield()")
    done = subprocess.run([str(exe), str(threads), "100000"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


@needs_cc
def test_no_data_race_under_thread_sanitizer(tmp_path):
    exe = build(tmp_path, "-O1", "-g", "-fsanitize=thread")
    if exe is None:
        pytest.skip("this compiler has no ThreadSanitizer")
    probe = subprocess.run([str(exe), "1", "1"], capture_output=True, text=True, timeout=60)
    if "ThreadSanitizer" in probe.stderr and probe.returncode != 0 and "ok" not in probe.stdout:
        pytest.skip(f"ThreadSanitizer cannot run here: {probe.stderr.strip()[:200]}")
    done = subprocess.run([str(exe), "5", "30000"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout
    assert "WARNING: ThreadSanitizer" not in done.stderr, done.stderr[-3000:]
