"""Where a decode step's time goes: torch.profiler over a few single-stream decode steps through
boot + executor (CPU-side op time, device kernel time), with random input tokens so routing
varies like a real model's. Prints the top ops by self CPU time and by device time, the calls
from the host per step, and how busy the expert copies kept PCIe: their busy time over the
profiled steps and the gaps between them (short ones: one copy kernel ending and the next
starting; one long one a step: the step's end and the next one's first layer).

    python3 bench/profile_decode.py --model DIR --load-format dummy --gpu-memory 24GiB \\
        [--moe-cache-size N] [--streams 1,8]

With `--draft-tokens d` (and --speculative-method) each profiled step is a verify step instead, as the scheduler
sends one: every row its token and d random drafts (a hybrid's state held in a snapshot for the step), with mtp
each row asking the head for d drafts after it, so the chain runs too; a row advances by what the verify kept
(shared/speculation.py's computed_after_verify), so random drafts, mostly refused, keep its length. What a drafting
step costs on the device beside a decode step's replay, kernel by kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_prefill import GRAPH_LAUNCHES, LAUNCHES, _union, device_timeline, is_expert_copy  # noqa: E402
from bench.serve_decode import Streams  # noqa: E402
from ferry.services.worker.boot import boot_worker  # noqa: E402
from ferry.services.worker.expert_cache_delta import COUNTERS, report_delta  # noqa: E402
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args  # noqa: E402
from ferry.shared.speculation import computed_after_verify  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_worker_flags(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--streams", default="1", help="decode this many requests together; a list (1,8) profiles each")
    parser.add_argument("--out", default=None, help="write the per-step call counts as JSON here")
    parser.add_argument(
        "--draft-tokens",
        type=int,
        default=0,
        help="profile verify steps of this many random drafts a row (with --speculative-method) instead of decode",
    )
    args = parser.parse_args()
    if args.draft_tokens and not args.speculative_method:
        parser.error("--draft-tokens profiles verify steps: give --speculative-method ngram or mtp")
    executor, plan = boot_worker(boot_config_from_args(args))
    rng = np.random.default_rng(0)
    runs = []
    for i, n in enumerate(int(s) for s in args.streams.split(",")):
        runs.append(
            profile_streams(
                executor, plan, n, args.steps, args.rows, rng, first_req_id=1 + 100 * i, drafts=args.draft_tokens
            )
        )
    if args.out:
        Path(args.out).write_text(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}, indent=1) + "\n")


def profile_streams(executor, plan, n: int, steps: int, rows: int, rng, first_req_id: int, drafts: int = 0) -> dict:
    """`steps` warm decode steps of `n` streams timed, then `steps` more under the profiler; with `drafts`, verify
    steps of that many random drafts a row (the module docstring)."""
    vocab = executor.spec.vocab_size
    streams = Streams(executor, n, 64 + 3 * steps * (1 + drafts) + 2 * drafts + 8, first_req_id=first_req_id)
    streams.prefill([rng.integers(0, vocab, 64).tolist() for _ in range(n)])
    hybrid = bool(plan.linear_state.slots)
    held = plan.linear_state_snapshots.snapshots
    if hybrid and drafts and held < n:
        raise SystemExit(f"{n} drafting rows hold their states in {n} snapshots; the plan has {held}")
    speculation = {}
    if drafts:
        speculation["draft_lens"] = np.full(n, drafts, np.int32)
        speculation["hold_state"] = np.arange(n, dtype=np.int32) if hybrid else None
        speculation["mtp_drafts"] = np.full(n, drafts, np.int32) if executor.mtp is not None else None

    def step():
        if not drafts:
            streams.step([[int(rng.integers(0, vocab))] for _ in range(n)], sample=True)
            return
        before = list(streams.context)
        out = streams.step([rng.integers(0, vocab, 1 + drafts).tolist() for _ in range(n)], sample=True, **speculation)
        kept = out.accepted_drafts.tolist()
        streams.context = [computed_after_verify(c, 1 + drafts, drafts, a, hybrid) for c, a in zip(before, kept)]

    for _ in range(steps):
        step()
    before = executor.expert_cache_report()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    ms = (time.perf_counter() - t0) / steps * 1e3
    cache = cache_per_step(before, executor.expert_cache_report(), steps)
    kind = f"verify steps of {drafts} drafts a row" if drafts else "decode steps"
    print(f"{n} streams, {kind}: ms/step without profiler: {ms:.2f}  (slots {plan.experts.slots}/{plan.experts.total})")
    print("expert cache per step (timed steps):", json.dumps(cache))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    streams.finish()
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=rows))
    if torch.cuda.is_available():
        print(table.table(sort_by="self_device_time_total", row_limit=rows))
    per_step = host_calls_per_step(table, steps)
    print("per decode step, calls from the host:", json.dumps(per_step))
    timeline = device_timeline(prof, is_expert_copy, largest=2 * steps) if torch.cuda.is_available() else {}
    print("copies on the device over the profiled steps:", json.dumps(timeline))
    kernels = kernel_families(prof, steps) if torch.cuda.is_available() else {}
    if kernels:
        print(
            f"device time per step: span {kernels['span_us']:.0f} µs, kernels {kernels['kernel_us']:.0f} µs, "
            f"gaps {kernels['gap_us']:.0f} µs over {kernels['kernels']:.0f} kernels"
        )
        for fam, row in kernels["families"].items():
            print(f"  {fam:<28} {row['count']:6.1f} kernels {row['us']:8.1f} µs")
    return {
        "steps": steps,
        "streams": n,
        "draft_tokens": drafts,
        "per_step": per_step,
        "ms_per_step_unprofiled": ms,
        "expert_cache_per_step": cache,
        "timeline": timeline,
        "kernels": kernels,
    }


def cache_per_step(before: dict, after: dict, steps: int) -> dict:
    """The expert cache's counters over `steps` steps, per step (what crossed PCIe: misses the host did not take,
    prefetches, and how many of those the next layer used), and the hit rate over them."""
    delta = report_delta(before, after)
    per_step = {k: round(delta[k] / steps, 1) for k in COUNTERS if k != "steps" and not k.endswith("_s")}
    return {
        **per_step,
        "hit_rate": round(delta["hit_rate"], 3),
        "prefetch_accuracy": round(delta["prefetch_accuracy"], 3),
    }


# CUDA runtime calls as the profiler names them that make the host wait (launches: profile_prefill.py)
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


# kernel name substring -> family, first match wins (the names Triton, fla, cuBLAS and torch give them)
FAMILIES = (
    ("routed experts gate/up", ("gate_up", "pair_gemv_13", "gemv13", "gemm13")),
    ("routed experts down", ("pair_gemv_2", "gemv2", "gemm2", "_down")),
    ("expert rows sum", ("rows_sum",)),
    ("expert cache lookup", ("lookup",)),
    ("expert copies", ("copy_experts", "unpack_experts")),
    ("gated delta rule", ("gated_delta", "fused_recurrent", "chunk_")),
    ("causal conv1d", ("conv1d",)),
    ("paged attention", ("paged_attention", "attention")),
    ("rms norm", ("rms_norm", "rmsnorm")),
    ("qk norm + rope", ("qk_norm", "rope")),
    ("gemm/gemv (cuBLAS)", ("gemv", "gemm", "sm90_xmma", "cutlass", "nvjet", "splitKreduce")),
    ("top-k / sort", ("topk", "sort", "radix")),
    ("softmax", ("softmax",)),
    (
        "elementwise",
        ("elementwise", "vectorized", "unrolled", "CatArrayBatched", "index", "scatter", "gather", "reduce", "fill"),
    ),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return family
    return "other"


def kernel_families(prof, steps: int) -> dict:
    """Device kernel time per step by family, the busy span per step and the gaps inside it (µs),
    and each distinct kernel name's count and time (so a family's members can be read)."""
    spans, named, by_name = [], [], {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or "Memcpy" in e.name or "Memset" in e.name:
            continue
        a, b = e.time_range.start, e.time_range.end
        spans.append((a, b))
        named.append((a, b, e.name))
        row = by_name.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += b - a
    if not spans:
        return {}
    spans.sort()
    busy = sum(b - a for a, b in _union(spans))
    # the span of each step: the profiled steps run back to back, so their span is the sum of the
    # steps' device spans plus the host's time between them; report the device-side view per step
    span = spans[-1][1] - spans[0][0]
    families: dict[str, dict] = {}
    for name, (count, us) in by_name.items():
        fam = families.setdefault(kernel_family(name), {"count": 0.0, "us": 0.0, "names": {}})
        fam["count"] += count / steps
        fam["us"] += us / steps
        fam["names"][name[:120]] = {"count": count / steps, "us": round(us / steps, 2)}
    families = dict(sorted(families.items(), key=lambda kv: -kv[1]["us"]))
    named.sort()
    gaps = [(named[i + 1][0] - named[i][1], named[i][2], named[i + 1][2]) for i in range(len(named) - 1)]
    large = [g for g in gaps if g[0] > 20]
    # the last two steps' kernels in order: (name, µs, µs idle before it), to read a step's sequence
    tail = named[-2 * len(named) // steps :]
    sequence = [
        (n[:70], round(b - a, 1), round(a - tail[i - 1][1], 1) if i else 0.0) for i, (a, b, n) in enumerate(tail)
    ]
    return {
        "span_us": span / steps,
        "kernel_us": busy / steps,
        "gap_us": (span - busy) / steps,
        "kernels": len(spans) / steps,
        "gaps_over_20us_per_step": len(large) / steps,
        "gap_over_20us_us_per_step": sum(g[0] for g in large) / steps,
        "largest_gaps": [(round(g[0], 1), g[1][:60], g[2][:60]) for g in sorted(large, reverse=True)[:12]],
        "families": families,
        "sequence": sequence,
    }


def host_calls_per_step(table, steps: int) -> dict:
    """Kernel launches, graph launches (a replay counts once) and host synchronisations per step;
    also the host-to-device and device-to-host copies issued (each a call, some of them waits)."""
    counts = {e.key: e.count for e in table}

    def total(names):
        return sum(counts.get(n, 0) for n in names) / steps

    return {
        "kernel_launches": total(LAUNCHES),
        "graph_launches": total(GRAPH_LAUNCHES),
        "host_synchronizations": total(WAITS),
        "memcpy_calls": total(("cudaMemcpyAsync", "cudaMemcpy")),
    }


if __name__ == "__main__":
    main()
