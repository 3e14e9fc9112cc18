"""Where a decode step's time goes: torch.profiler over a few single-stream decode steps through
boot + executor (CPU-side op time, device kernel time), with random input tokens so routing
varies like a real model's. Prints the top ops by self CPU time and by device time, the calls
from the host per step, and how busy the expert copies kept PCIe: their busy time over the
profiled steps and the gaps between them (short ones: one copy kernel ending and the next
starting; one long one a step: the step's end and the next one's first layer).

    python3 bench/profile_decode.py --model DIR --load-format dummy --gpu-memory 24GiB [--moe-cache-size N]
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

from bench.profile_prefill import GRAPH_LAUNCHES, LAUNCHES, device_timeline, is_host_to_device  # noqa: E402
from bench.serve_decode import Streams  # noqa: E402
from ferry.services.worker.boot import boot_worker  # noqa: E402
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_worker_flags(parser)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--out", default=None, help="write the per-step call counts as JSON here")
    args = parser.parse_args()
    executor, plan = boot_worker(boot_config_from_args(args))
    rng = np.random.default_rng(0)
    vocab = executor.spec.vocab_size
    streams = Streams(executor, 1, 64 + 3 * args.steps + 8, first_req_id=1)
    streams.prefill([rng.integers(0, vocab, 64).tolist()])

    def step():
        streams.step([[int(rng.integers(0, vocab))]], sample=True)

    for _ in range(args.steps):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"ms/step without profiler: {ms:.2f}  "
          f"(slots {plan.experts.slots}/{plan.experts.total})")  # fmt: skip
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if torch.cuda.is_available():
        print(table.table(sort_by="self_device_time_total", row_limit=args.rows))
    per_step = host_calls_per_step(table, args.steps)
    print("per decode step, calls from the host:", json.dumps(per_step))
    timeline = device_timeline(prof, is_expert_copy, largest=2 * args.steps) if torch.cuda.is_available() else {}
    print("copies on the device over the profiled steps:", json.dumps(timeline))
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "per_step": per_step, "ms_per_step_unprofiled": ms,
                                              "timeline": timeline}, indent=1) + "\n")  # fmt: skip


def is_expert_copy(name: str) -> bool:
    """The device events that move experts: the copy kernel or the unpacking one (packed banks), on
    graph-safe steps, or a host-to-device copy (copy-engine steps, and the step's input upload)."""
    return "copy_experts" in name or "unpack_experts" in name or is_host_to_device(name)


# CUDA runtime calls as the profiler names them that make the host wait (launches: profile_prefill.py)
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")


def host_calls_per_step(table, steps: int) -> dict:
    """Kernel launches, graph launches (a replay counts once) and host synchronisations per step;
    also the host-to-device and device-to-host copies issued (each a call, some of them waits)."""
    counts = {e.key: e.count for e in table}

    def total(names):
        return sum(counts.get(n, 0) for n in names) / steps

    return {"kernel_launches": total(LAUNCHES), "graph_launches": total(GRAPH_LAUNCHES),
            "host_synchronizations": total(WAITS), "memcpy_calls": total(("cudaMemcpyAsync", "cudaMemcpy"))}  # fmt: skip


if __name__ == "__main__":
    main()
