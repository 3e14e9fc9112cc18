"""The host's time for one expert against its tokens, and the straight-line price the split uses (issue 25).

The host's share of a step (services/worker/offload/host_compute/prefill_share.py, decode_share.py) prices one expert on
the host as a line in its tokens, `host_s_at_1 + host_s_per_token x (n - 1)`, from two points the boot
calibration measures. The host kernel is memory bound at few tokens (it reads the expert once, about flat
in n) and compute bound past some tens (it multiplies it n times), so the line's second point decides what
prefill steps of tens to hundreds of tokens an expert are charged. This times Ferry's host path
(`HostExperts.compute`, the C kernel by default) at each of `--tokens`, `--per-call` experts a call as a
layer's share hands them over, fresh experts each call (round-robin over a bank bigger than the caches), and prints
every line through 1 token and one of `--points` beside each measurement: `ratio` is the line's price over the time
taken (below 1: the split gives the host more than it can do in that time).

    python3 bench/host_price_tokens.py --threads 2 --out bench/results/host_price_tokens_epyc2.json

`--huge-pages off` times the same kernel on a bank left on small pages (the worker advises its banks onto
transparent huge pages: services/worker/offload/host_memory/huge_pages.py);
the result records the host's THP mode and how much of the process huge pages backed.

`--link-load none,packed` times every token count again while the GPU unpacks other pinned experts at the
link's rate (bench/link_load.py), as the next layer's prefetch does beside the host's share of a served
decode layer: both read the host's DRAM (FreeToken's calibration on the H200's host measured its
CPU kernel at 104.8 GB/s alone and 77.6 beside the PCIe gather). `expert_us_under_packed` holds those
times and `link_load_GBps` what the load kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu_expert_bw import _cpu_name, format_banks, on_thread  # noqa: E402
from bench.cpu_steal import StealMeter  # noqa: E402
from bench.huge_pages import anon_huge_bytes, thp_mode  # noqa: E402
from bench.link_load import KINDS, LinkLoad  # noqa: E402
from ferry.plan.expert_backend import chosen_host_cpus, format_cpu_list, pool_thread_cpus  # noqa: E402
from ferry.plan.model_config import load_model_config  # noqa: E402
from ferry.services.worker.offload.host_compute.host_experts import HostExperts  # noqa: E402


def expert_seconds(host: HostExperts, tokens: int, repeats: int, experts: int, per_call: int, load=None) -> float:
    """Median seconds an expert, `per_call` experts of `tokens` tokens each a call (as a layer's share hands
    them over together), each call on the next experts of the bank; with `load` (bench/link_load.py), the
    link kept full through each call."""
    x = torch.randn(tokens, host.hidden_size).to(torch.bfloat16)
    times = []
    for i in range(repeats + 1):
        pairs = [(t, (i * per_call + e) % experts, 1.0) for e in range(per_call) for t in range(tokens)]
        if load is not None:
            load.keep_ahead()
        t0 = time.perf_counter()
        host.compute(0, x, pairs)
        if i:  # the first call pays the pool's first use
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / per_call


def lines(measured: dict[int, float], points: list[int]) -> dict[int, dict[int, float]]:
    """For each second point p: the line through (1, t1) and (p, tp), as its price over the time of every n."""
    t1 = measured[1]
    out = {}
    for p in points:
        slope = max(0.0, (measured[p] - t1) / (p - 1))
        out[p] = {n: round((t1 + slope * (n - 1)) / t, 3) for n, t in measured.items()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tests/data/models/qwen3.6-35b-a3b", help="a model directory (its config.json)")
    p.add_argument("--format", default="bf16", choices=("bf16", "packed", "nvfp4", "fp8"))
    p.add_argument("--backend", default="c", choices=("c", "torch"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", default="1,4,8,16,32,42,64,129,256")
    p.add_argument("--points", default="16,64", help="second points of the lines compared (each among --tokens)")
    p.add_argument("--experts", type=int, default=48, help="experts in the walked bank (more than the caches hold)")
    p.add_argument("--per-call", type=int, default=8, help="experts a call (the calibration times 8 a call)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--huge-pages",
        default="on",
        choices=("on", "off"),
        help="the bank advised onto transparent huge pages as the worker's are, or left on small pages",
    )
    p.add_argument(
        "--cpus",
        default="auto",
        help="the kernel's threads' CPUs as --host-expert-cpus takes them (the first the caller's, which "
        "here is the bench's own thread and stays unpinned): auto (the worker's default), none, or a "
        "CPU list",
    )
    p.add_argument(
        "--link-load",
        default="none",
        help="none, then any of packed (the GPU unpacking pinned experts beside each call, as served), "
        "plain (its copy kernel over bf16 banks) and ce (the copy engine), comma-separated; they need "
        "CUDA",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    loads = args.link_load.split(",")
    if loads[0] != "none" or any(k not in KINDS for k in loads[1:]) or len(set(loads)) != len(loads):
        p.error(
            f"--link-load {args.link_load}: none, then any of {', '.join(KINDS)}, each once (the lines are "
            "drawn through the times without a load)"
        )
    if set(loads) - {"none"} and not torch.cuda.is_available():
        p.error(f"--link-load {args.link_load}: a load needs a CUDA device")
    tokens = sorted({int(t) for t in args.tokens.split(",")} | {1})
    points = [int(t) for t in args.points.split(",")]
    if missing := [q for q in points if q not in tokens or q < 2]:
        p.error(f"--points {missing} must be among --tokens and above 1")
    spec = load_model_config(args.config)
    torch.set_num_threads(1)  # the measuring thread's own team: see bench/cpu_expert_bw.py
    banks = format_banks(
        args.format, spec.hidden_size, spec.moe_intermediate_size, args.experts, args.huge_pages == "on"
    )
    huge = anon_huge_bytes()  # while the bank lives: how much of it huge pages back
    cpus = chosen_host_cpus(args.threads, args.cpus)
    host = HostExperts(banks, torch.bfloat16, args.threads, kernel=args.backend, cpus=cpus)
    # the started workers' CPUs (this bench's caller is its own thread, never pinned)
    workers = pool_thread_cpus(args.threads, cpus)[1]
    pinned = format_cpu_list(sorted(set(workers[: host.c_kernel.pinned]))) if host.c_kernel is not None else ""
    loaded, load_gbps = {}, {}
    with StealMeter() as steal:
        for kind in loads:
            load = None if kind == "none" else LinkLoad(kind, torch.device("cuda"))
            loaded[kind] = {
                n: on_thread(1, expert_seconds, host, n, args.repeats, args.experts, args.per_call, load)
                for n in tokens
            }
            if load is not None:
                load.end_timed()
                rate = load.gbps()
                load_gbps[kind] = None if rate is None else round(rate, 1)
                load.close()
    host.close()
    measured = loaded["none"]
    ratios = lines(measured, points)
    print(
        f"THP mode {thp_mode()}, huge pages advised: {args.huge_pages}, {huge} bytes on huge pages "
        f"of a {banks.nbytes}-byte bank; threads pinned to CPUs {pinned or 'none'}; CPU time stolen {steal.fraction}"
    )
    for n, t in measured.items():
        print(f"{n:4d} tokens {t * 1e6:9.1f} us  " + "  ".join(f"line via {q}: {ratios[q][n]:.2f}" for q in points))
    for kind in loads[1:]:
        print(
            f"beside the {kind} load ({load_gbps.get(kind, 0.0)} GB/s): "
            + ", ".join(f"{n} tokens {t * 1e6:.1f} us" for n, t in loaded[kind].items())
        )
    result = {
        "config": args.config,
        "format": args.format,
        "backend": args.backend,
        "threads": args.threads,
        "per_call": args.per_call,
        "cpu": _cpu_name(),
        "thp_mode": thp_mode(),
        "huge_pages_advised": args.huge_pages == "on",
        "anon_huge_bytes": huge,
        "bank_bytes": banks.nbytes,
        "pinned_cpus": pinned,
        "cpu_steal_fraction": steal.fraction,
        "hidden": spec.hidden_size,
        "moe_intermediate": spec.moe_intermediate_size,
        "expert_us": {n: round(t * 1e6, 1) for n, t in measured.items()},
        "link_loads": loads,
        **{f"expert_us_under_{k}": {n: round(t * 1e6, 1) for n, t in loaded[k].items()} for k in loads[1:]},
        "link_load_GBps": load_gbps,
        "price_over_time": {f"line_via_{q}": r for q, r in ratios.items()},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
