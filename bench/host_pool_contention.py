"""The host kernel's calls on a busy host (issue 25): a decode layer's host share, timed call by call
while other processes take CPU time beside the kernel's threads, as the api, the scheduler, the
worker's Python thread and the CUDA driver's threads do on a serving host.

Each call computes `--experts` experts of one MoE layer for `--tokens` tokens (a layer's host share at
one stream), calls `--gap-us` apart as a decode step's layers are; the step waits for the slowest
thread of each call, so the figure that matters is the mean (and the tail), not the median.
`--hog BUSY/IDLE` (milliseconds, several allowed) runs one busy-looping process on each of
`--hog-cpus`, busy for BUSY and asleep for IDLE in turn (`100/0`: always busy); `none` runs none.

`--spin-us 50,1000` times this tree's kernel once a spin of its idle threads before they sleep (a layer's
call finds them awake, or wakes them by a futex), alternated the same way.

`--compare-library PATH` times a second build of the kernel (e.g. one built from an older commit's
sources) beside this tree's, blocks of calls alternated so that both meet the same contention: how the
work split between the threads behaves under it. Per variant and hog: median, mean, p90, p99 and the
longest call in µs, and the bank bytes of a call over its mean time.

    python3 bench/host_pool_contention.py --threads 2 --hog none,100/0,1/1 --hog-cpus 1
    python3 bench/host_pool_contention.py --threads 12 --hog none,100/0,1/1 --hog-cpus 3,7 \\
        --compare-library /tmp/old/kernels/_host_experts_c.cpython-312-x86_64-linux-gnu.so
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_expert_bw import _cpu_name, format_banks  # noqa: E402
from ferry.plan.model_config import load_model_config  # noqa: E402
from ferry.services.worker.offload.host_compute import host_expert_kernel as K  # noqa: E402

HOG = (
    "import time\nwhile True:\n t = time.perf_counter() + {busy}\n"
    " while time.perf_counter() < t: pass\n time.sleep({idle})"
)


def start_hogs(spec: str, cpus: list[int]) -> list[subprocess.Popen]:
    """One busy-looping process a CPU of `cpus`, pinned there: busy BUSY ms, then asleep IDLE ms."""
    if spec == "none":
        return []
    busy, idle = (float(v) / 1e3 for v in spec.split("/"))
    code = HOG.format(busy=busy, idle=idle)
    hogs = [subprocess.Popen([sys.executable, "-c", code]) for _ in cpus]
    for hog, cpu in zip(hogs, cpus):
        os.sched_setaffinity(hog.pid, {cpu})
    time.sleep(0.3)
    return hogs


class OtherBuild(K.HostKernel):
    """The kernel from a build of other sources: an entry point it lacks leaves that setting as it built it."""

    def set_prefetch(self, nbytes: int) -> None:
        if hasattr(self.lib, "ferry_host_kernel_set_prefetch"):
            super().set_prefetch(nbytes)

    def set_spin(self, spin_us: int) -> None:
        if hasattr(self.lib, "ferry_host_kernel_set_spin"):
            super().set_spin(spin_us)


def kernel(banks, threads: int, path: str | None, cpus: list[int], spin_us: int | None = None) -> K.HostKernel:
    """A HostKernel over `banks` from this tree's library (its idle threads spinning `spin_us`), or from the
    build at `path`."""
    if path is None:
        return K.HostKernel(banks, torch.bfloat16, threads, cpus=cpus, spin_us=spin_us)
    lib = ctypes.CDLL(path)
    K.bind(lib)  # what it has: an older build lacks the newer entry points, which its kernel does not call
    return OtherBuild(banks, torch.bfloat16, threads, cpus=cpus, lib=lib)


def summary(times: list[float], nbytes: int) -> dict:
    t = sorted(times)
    n, mean = len(t), sum(t) / len(t)
    us = lambda v: round(v * 1e6, 1)  # noqa: E731
    return {
        "median_us": us(t[n // 2]),
        "mean_us": us(mean),
        "p90_us": us(t[int(n * 0.9)]),
        "p99_us": us(t[int(n * 0.99)]),
        "max_us": us(t[-1]),
        "mean_GBps": round(nbytes / mean / 1e9, 2),
        "calls": n,
    }


def run(kernels: dict, banks, args, spec: str) -> dict:
    """Blocks of `--block` calls, each variant in turn (the order flipped every round), a fresh expert
    window each call; the first 10 calls of a block untimed (a block's start pays the other's spin)."""
    x = torch.randn(args.tokens, banks.hidden_size).to(torch.bfloat16)
    times: dict = {name: [] for name in kernels}
    hogs = start_hogs(spec, args.hog_cpus)
    try:
        call = 0
        for round_ in range(args.rounds):
            order = list(kernels.items()) if round_ % 2 == 0 else list(kernels.items())[::-1]
            for name, k in order:
                for j in range(args.block):
                    first = call * args.experts
                    pairs = [
                        (t, (first + e) % banks.num_experts, 1.0 / args.experts)
                        for t in range(args.tokens)
                        for e in range(args.experts)
                    ]
                    call += 1
                    t0 = time.perf_counter()
                    k.compute(0, x, pairs)
                    took = time.perf_counter() - t0
                    if j >= 10:
                        times[name].append(took)
                    until = time.perf_counter() + args.gap_us * 1e-6
                    while time.perf_counter() < until:
                        pass
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    nbytes = args.experts * banks.expert_nbytes
    return {name: summary(t, nbytes) for name, t in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "tests/data/models/qwen3-30b-a3b"))
    ap.add_argument("--format", default="bf16", choices=("bf16", "packed", "nvfp4", "fp8"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pin", action="store_true", help="pin the started threads to CPUs 1..threads-1 (else unpinned)")
    ap.add_argument("--experts", type=int, default=3, help="experts a call (a layer's host share)")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--bank-experts", type=int, default=64, help="experts in the bank (larger than the caches)")
    ap.add_argument("--gap-us", type=float, default=500.0, help="between calls, as between a step's layers")
    ap.add_argument("--hog", default="none,100/0,1/1", help="comma-separated BUSY/IDLE ms, or none")
    ap.add_argument("--hog-cpus", default="1", help="comma-separated CPUs, one hog each")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--block", type=int, default=150)
    ap.add_argument("--compare-library", default=None, help="a second build of the kernel to time beside this one")
    ap.add_argument(
        "--spin-us",
        default=None,
        help="comma-separated spins of the idle threads (FERRY_HOST_POOL_SPIN_US): the tree's kernel once "
        "each, the first as `tree`, the others as `tree_spin<N>us`",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.hog_cpus = [int(c) for c in args.hog_cpus.split(",")]
    cfg = load_model_config(args.config)
    banks = format_banks(args.format, cfg.hidden_size, cfg.moe_intermediate_size, args.bank_experts)
    cpus = list(range(1, args.threads)) if args.pin else []
    spins = [int(v) for v in args.spin_us.split(",")] if args.spin_us else [None]
    kernels = {
        "tree" if i == 0 else f"tree_spin{us}us": kernel(banks, args.threads, None, cpus, us)
        for i, us in enumerate(spins)
    }
    if args.compare_library:
        kernels["compared"] = kernel(banks, args.threads, args.compare_library, cpus)
    rows = []
    for spec in args.hog.split(","):
        for name, stats in run(kernels, banks, args, spec).items():
            row = {
                "variant": name,
                "hog": spec,
                "hog_cpus": args.hog_cpus,
                "threads": args.threads,
                "format": args.format,
                "experts": args.experts,
                "tokens": args.tokens,
                **stats,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    for k in kernels.values():
        k.close()
    if args.json:
        out = {
            "rows": rows,
            "compare_library": args.compare_library,
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "gap_us": args.gap_us,
            "pinned": args.pin,
            "spin_us": args.spin_us,
            "config": Path(args.config).name,
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
