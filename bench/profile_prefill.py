"""Where a long prefill's time goes, through boot + executor: the step's wall time, how long the
host took to enqueue it, and from a torch.profiler trace of one prefill the copy engine's busy
time (host -> device copies), the gaps in it, and the compute kernels' busy time. A prefill of an
offloaded model is bound by PCIe: the busy copy time over the step's time says how close it runs.

    python3 bench/profile_prefill.py --model DIR --load-format dummy --moe-cache-size 512 --gpu-memory 12GiB \\
        [--prompt-len 2000] [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_decode import Streams, _cache_counters, _delta  # noqa: E402
from ferry.services.worker.boot import boot_worker  # noqa: E402
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_flags(parser)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--ring-chunks", default="", help="also time these staging-ring chunk sizes (experts), e.g. 4,16"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    executor, plan = boot_worker(boot_config_from_args(args))
    if args.prompt_len > plan.max_prefill_tokens:
        raise SystemExit(f"--prompt-len {args.prompt_len} is over the plan's {plan.max_prefill_tokens}-token step")
    rng = np.random.default_rng(0)
    vocab = executor.spec.vocab_size
    req = [1]

    def prefill() -> float:
        """Wall seconds of one prefill step (the executor returns once its token is sampled)."""
        streams = Streams(executor, 1, args.prompt_len + 8, first_req_id=req[0])
        req[0] += 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        streams.prefill([rng.integers(0, vocab, args.prompt_len).tolist()])
        wall = time.perf_counter() - t0
        streams.finish()
        return wall

    prefill()  # first use of this prompt length
    ring = getattr(executor.store, "ring", None)
    by_chunk = {}
    for chunk in [int(c) for c in args.ring_chunks.split(",") if c]:
        if ring is not None and chunk <= ring.size:
            default = (ring.base_chunk, ring.long_chunk)
            ring.use_chunks(chunk, chunk)
            by_chunk[chunk] = statistics.median(prefill() for _ in range(args.runs))
            ring.use_chunks(*default)
    walls = [prefill() for _ in range(args.runs)]
    before = _cache_counters(executor)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        profiled_wall = prefill()
    copied = _delta(_cache_counters(executor), before)  # the profiled prefill's own
    from bench.profile_decode import kernel_families  # which imports this module

    result = {
        "prompt_len": args.prompt_len,
        "wall_s": walls,
        "median_wall_s": statistics.median(walls),
        "profiled_wall_s": profiled_wall,
        "slots": plan.experts.slots,
        "experts": plan.experts.total,
        "ring_chunk": ring.base_chunk if ring is not None else None,
        "median_wall_s_by_ring_chunk": by_chunk,
        "profiled_prefill_expert_cache": copied,
        **device_timeline(prof, is_expert_copy),
        "kernels": kernel_families(prof, 1),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def is_host_to_device(name: str) -> bool:
    return "Memcpy HtoD" in name  # the expert copies, and the step's own uploads


def is_expert_copy(name: str) -> bool:
    """The device events that move experts: the copy kernel or the unpacking one (packed banks), on
    graph-safe steps, or a host-to-device copy (copy-engine steps, and the step's input upload)."""
    return "copy_experts" in name or "unpack_experts" in name or is_host_to_device(name)


def device_timeline(prof, is_copy=is_host_to_device, largest: int = 8) -> dict:
    """Busy time and gaps of the expert copies (`is_copy` of the device event's name: by default the
    host -> device copies) and of the compute kernels, from the trace (µs)."""
    copies, kernels, launches, named = [], [], [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            if e.name in HOST_LAUNCHES:
                launches.append((e.time_range.start, e.time_range.end))
            continue
        span = (e.time_range.start, e.time_range.end)
        if is_copy(e.name):
            copies.append(span)
        elif "Memcpy" not in e.name and "Memset" not in e.name:
            kernels.append(span)
            named.append((*span, e.name))
    if not copies:
        return {"copies": 0}
    merged = _union(copies)
    start, end = merged[0][0], merged[-1][1]
    busy = sum(b - a for a, b in merged)
    gaps_at = [(a[1] - start, b[0] - a[1]) for a, b in zip(merged, merged[1:])]  # (opens after the first copy, long)
    gaps = [g for _, g in gaps_at]
    at = sorted(gaps_at, key=lambda g: -g[1])[:largest]
    first_kernel = min(k[0] for k in kernels) if kernels else start
    last_kernel = max(k[1] for k in kernels) if kernels else end
    return {
        "copies": len(copies),
        "copy_span_ms": (end - start) / 1e3,
        "copy_busy_ms": busy / 1e3,
        "copy_gaps_over_50us": sum(1 for g in gaps if g > 50),
        "copy_gap_ms": sum(gaps) / 1e3,
        "copy_gaps_under_20us": sum(1 for g in gaps if g < 20),
        "copy_gap_under_20us_ms": sum(g for g in gaps if g < 20) / 1e3,
        "largest_copy_gaps_ms": [g / 1e3 for _, g in at],
        # where they open, from the first copy: (ms after it, ms long)
        "largest_copy_gaps_at_ms": [(round(t / 1e3, 3), round(g / 1e3, 3)) for t, g in at],
        "device_span_ms": (max(last_kernel, end) - min(first_kernel, start)) / 1e3,
        "before_first_copy_ms": (start - first_kernel) / 1e3,
        "after_last_copy_ms": (last_kernel - end) / 1e3,
        "kernel_busy_ms": sum(b - a for a, b in _union(kernels)) / 1e3,
        # what computed while the copies paused: the kernels of the four longest gaps, by time inside them
        "kernels_in_largest_gaps": [_busiest(named, start + t, start + t + g) for t, g in at[:4]],
        # how long the host took to enqueue the step, from its first launch or copy to its last
        "host_enqueue_span_ms": (max(b for _, b in launches) - min(a for a, _ in launches)) / 1e3 if launches else None,
        "host_launches": len(launches),
    }


# CUDA runtime/driver calls as the profiler names them: what launches work
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
GRAPH_LAUNCHES = ("cudaGraphLaunch",)
HOST_LAUNCHES = LAUNCHES + GRAPH_LAUNCHES + ("cudaMemcpyAsync",)


def _busiest(named: list[tuple[float, float, str]], lo: float, hi: float, top: int = 3) -> list[tuple[str, float]]:
    """The `top` kernel names by their time (ms) inside [lo, hi] (µs)."""
    inside: dict[str, float] = {}
    for a, b, name in named:
        overlap = min(b, hi) - max(a, lo)
        if overlap > 0:
            inside[name[:120]] = inside.get(name[:120], 0.0) + overlap / 1e3
    return sorted(inside.items(), key=lambda kv: -kv[1])[:top]


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


if __name__ == "__main__":
    main()
