"""How fast the host computes an expert where it lies (issue 25): the first measurement of the CPU path.

A miss can be paid by copying the expert over PCIe, or by computing it on the CPU from the host bank
it lies in. The CPU path is worth it when torch's CPU kernels read an expert's bytes near what the
host's memory delivers. Here, for each thread count:

* `read_GBps`: the host's read bandwidth, a sum over a block larger than the caches (STREAM-like);
* `expert_GBps`: one routed expert of the model's shapes for `tokens` tokens, gate/up then SiLU-and-mul
  then down, as torch computes it on the CPU from bf16 weights (oneDNN/AVX-512 where the CPU has them),
  over the expert's bytes;
* `expert_us`: the time of one such expert (median of `--repeats`, after warm-up).

Experts are taken round-robin from a bank of `--experts` experts bigger than the caches, as misses
would be, so every one is read from memory.

    python3 bench/cpu_expert_bw.py --config tests/data/models/qwen3-30b-a3b --threads 1,2,4,8,15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferry.plan.model_config import load_model_config  # noqa: E402


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """GB/s of a sum over a float32 block of `nbytes`, best of `repeats` (one warm-up)."""
    block = torch.ones(nbytes // 4, dtype=torch.float32)
    block.sum()
    best = min(_timed(lambda: block.sum()) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on the CPU: x [T, H]; w13 [2I, H] (gate rows, then up rows); w2 [H, I]."""
    gate_up = torch.nn.functional.linear(x, w13)
    inter = w13.shape[0] // 2
    h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return torch.nn.functional.linear(h, w2)


def expert_bandwidth(hidden: int, inter: int, tokens: int, experts: int, repeats: int) -> tuple[float, float]:
    """(GB/s of expert bytes, median µs an expert) over a round-robin walk of `experts` bf16 experts."""
    w13 = torch.randn(experts, 2 * inter, hidden).to(torch.bfloat16)
    w2 = torch.randn(experts, hidden, inter).to(torch.bfloat16)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    for e in range(min(experts, 4)):
        expert_ffn(x, w13[e], w2[e])
    times = []
    for i in range(repeats):
        e = i % experts
        times.append(_timed(lambda: expert_ffn(x, w13[e], w2[e])))
    per = statistics.median(times)
    nbytes = (w13[0].numel() + w2[0].numel()) * 2
    return nbytes / per / 1e9, per * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tests/data/models/qwen3-30b-a3b", help="a model directory (its config.json)")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--experts", type=int, default=48, help="experts in the walked bank (more than the caches hold)")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--read-bytes", type=int, default=1 << 30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = load_model_config(args.config)
    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    rows = []
    for n in threads:
        torch.set_num_threads(n)
        gbps, us = expert_bandwidth(spec.hidden_size, spec.moe_intermediate_size, args.tokens, args.experts, args.repeats)
        rows.append({"threads": n, "read_GBps": round(read_bandwidth(args.read_bytes, 5), 1),
                     "expert_GBps": round(gbps, 1), "expert_us": round(us, 1)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    result = {"config": args.config, "hidden": spec.hidden_size, "moe_intermediate": spec.moe_intermediate_size,
              "tokens": args.tokens, "cpu": _cpu_name(), "cores": cores, "torch": torch.__version__, "rows": rows}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
