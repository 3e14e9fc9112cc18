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

`--format bf16,packed,nvfp4,fp8` times Ferry's own host path instead
(services/worker/offload/host_compute/host_experts.py) on one MoE layer's host bank of that expert format,
filled as `--load-format dummy` fills it, bf16
activations: `bank_GBps` is the expert's bank bytes (what a PCIe copy of it would move) over the time of
`HostExperts.compute` for one expert and `tokens` tokens, `decode_us` the part of it that turns the bank's
rows into bf16 weights (0 for plain bf16 banks, read in place).

`--backend torch,c` picks HostExperts' backends to time (default torch): `c` is the host's own kernel
(services/worker/offload/host_compute/host_expert_kernel.py), on its own pool of `threads` pthreads, its rows'
instruction set `--isa` (auto: AVX-512 BF16 where the CPU has it); it decodes in its rows, so no `decode_us` is given.
`--prefetch 0,1024,4096` times it at each of those prefetch distances (bytes the rows fetch ahead of the
weights they multiply; FERRY_HOST_KERNEL_PREFETCH), the distances alternated call by call on fresh
experts so that a busy host slows them alike: a row each, with `prefetch`.

Every measurement runs on a thread of its own whose OpenMP team is `threads` wide, and the main thread
keeps one thread: two teams on a host with fewer cores than their threads put libgomp's helpers to
sleep between parallel regions (its throttled spin), and each of the decode's many small ops then pays
a wake-up (bench/NOTES.md, issue 25: a packed decode took 7.3 ms instead of 1.5 on the 2-core EPYC).

    python3 bench/cpu_expert_bw.py --config tests/data/models/qwen3-30b-a3b --threads 1,2,4,8,15
    python3 bench/cpu_expert_bw.py --threads 1,2 --format bf16,packed,nvfp4,fp8
    python3 bench/cpu_expert_bw.py --threads 1,2 --format bf16,fp8,nvfp4 --backend torch,c
    python3 bench/cpu_expert_bw.py --threads 1,8,15 --format bf16,packed --backend c --prefetch 0,1024,4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferry.plan.model_config import load_model_config  # noqa: E402
from ferry.services.worker.expert_formats.fp8_block import Fp8BlockExperts  # noqa: E402
from ferry.services.worker.expert_formats.nvfp4 import Nvfp4Experts  # noqa: E402
from ferry.services.worker.offload.host_compute.host_expert_weights import expert_reader  # noqa: E402
from ferry.services.worker.offload.host_compute.host_experts import HostExperts  # noqa: E402
from ferry.services.worker.offload.host_memory.host_banks import HostBanks  # noqa: E402
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks  # noqa: E402

FORMATS = ("bf16", "packed", "nvfp4", "fp8")
BACKENDS = ("torch", "c")


def read_bandwidth(nbytes: int, repeats: int) -> float:
    """GB/s of a sum over a float32 block of `nbytes`, best of `repeats` (one warm-up)."""
    block = torch.ones(nbytes // 4, dtype=torch.float32)
    block.sum()
    best = min(_timed(lambda: block.sum()) for _ in range(repeats))
    return nbytes / best / 1e9


def on_thread(threads: int, fn, *args):
    """fn(*args) on a new thread with an OpenMP team of `threads`; the thread, and its team, end after."""
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,)) as pool:
        return pool.submit(fn, *args).result()


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


def format_banks(fmt: str, hidden: int, inter: int, experts: int, huge_pages: bool = True):
    """One MoE layer of `experts` host experts in `fmt`, with --load-format dummy's weights; `huge_pages`:
    its blocks advised onto transparent huge pages, as the worker's are (False: left on small pages)."""
    if fmt == "packed":
        banks = PackedHostBanks.allocate(1, experts, hidden, inter, pin=False, progress=False, huge_pages=huge_pages)
    else:
        layout = {"bf16": None, "nvfp4": Nvfp4Experts(hidden, inter), "fp8": Fp8BlockExperts(hidden, inter)}[fmt]
        banks = HostBanks.allocate(
            1, experts, hidden, inter, torch.bfloat16, pin=False, progress=False, fmt=layout, huge_pages=huge_pages
        )
    banks.fill_dummy(seed=0, progress=False)
    banks.seal()
    return banks


def decode_time(banks, repeats: int) -> float:
    """Median seconds the expert reader takes to decode one expert, round-robin over the bank."""
    reader = expert_reader(banks, torch.bfloat16)
    return statistics.median(_timed(lambda: reader.expert(0, i % banks.num_experts)) for i in range(repeats))


def host_experts_bandwidth(
    banks,
    threads: int,
    tokens: int,
    repeats: int,
    backend: str = "torch",
    isa: str | None = None,
    prefetches: Sequence[int] = (),
) -> list[dict]:
    """HostExperts.compute of one expert for `tokens` tokens, round-robin over the bank's experts, and
    for the torch backend the decode alone (on a thread of as many threads); one dict, or one a
    `prefetches` distance of the c backend, alternated call by call."""
    if prefetches and backend != "c":
        raise ValueError(f"--prefetch times the c backend's rows, not the {backend} backend")
    decode = on_thread(threads, decode_time, banks, repeats) if backend == "torch" else None
    host = HostExperts(banks, torch.bfloat16, threads, kernel=backend, isa=isa)
    distances = list(prefetches) or [None]
    x = torch.randn(tokens, banks.hidden_size).to(torch.bfloat16)
    pairs = lambda e: [(t, e, 1.0 / tokens) for t in range(tokens)]  # noqa: E731
    for e in range(min(banks.num_experts, 4)):
        host.compute(0, x, pairs(e))
    times: dict = {d: [] for d in distances}
    for i in range(repeats):
        for j, d in enumerate(distances):
            if d is not None:
                host.c_kernel.set_prefetch(d)
            e = (i * len(distances) + j) % banks.num_experts  # a fresh expert each call, whatever the distance
            times[d].append(_timed(lambda: host.compute(0, x, pairs(e))))
    isa = host.c_kernel.isa if host.c_kernel is not None else None
    prefetch_now = host.c_kernel.prefetch if host.c_kernel is not None else None
    host.close()
    out = []
    for d in distances:
        per = statistics.median(times[d])
        out.append(
            {
                "bank_GBps": round(banks.expert_nbytes / per / 1e9, 2),
                "expert_us": round(per * 1e6, 1),
                "decode_us": None if decode is None else round(decode * 1e6, 1),
                "isa": isa,
                "prefetch": prefetch_now if d is None else d,
                "bank_MB": round(banks.expert_nbytes / 1e6, 2),
            }
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tests/data/models/qwen3-30b-a3b", help="a model directory (its config.json)")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--experts", type=int, default=48, help="experts in the walked bank (more than the caches hold)")
    p.add_argument("--repeats", type=int, default=60)
    p.add_argument("--read-bytes", type=int, default=1 << 30)
    p.add_argument(
        "--format",
        default=None,
        help=f"comma-separated bank formats ({', '.join(FORMATS)}): time "
        "Ferry's host path on them instead of bare torch",
    )
    p.add_argument(
        "--backend", default="torch", help=f"comma-separated HostExperts backends ({', '.join(BACKENDS)}) for --format"
    )
    p.add_argument("--isa", default=None, choices=("auto", "avx512", "portable"), help="the c backend's rows")
    p.add_argument(
        "--prefetch",
        default=None,
        help="comma-separated prefetch distances in bytes for the c backend's "
        "rows, alternated call by call (default: FERRY_HOST_KERNEL_PREFETCH)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = load_model_config(args.config)
    cores = os.cpu_count() or 1
    threads = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, cores})
    formats = args.format.split(",") if args.format else []
    if unknown := [f for f in formats if f not in FORMATS]:
        p.error(f"unknown --format {', '.join(unknown)} (one of {', '.join(FORMATS)})")
    backends = args.backend.split(",")
    if unknown := [b for b in backends if b not in BACKENDS]:
        p.error(f"unknown --backend {', '.join(unknown)} (one of {', '.join(BACKENDS)})")
    try:
        prefetches = [int(d) for d in args.prefetch.split(",")] if args.prefetch else []
    except ValueError:
        p.error(f"--prefetch takes whole numbers of bytes, got {args.prefetch!r}")
    if any(d < 0 for d in prefetches) or (prefetches and backends != ["c"]):
        p.error("--prefetch takes distances of 0 bytes or more, with --backend c alone")
    torch.set_num_threads(1)  # before any parallel op: this thread never owns an OpenMP team (docstring)
    rows = []
    for fmt in formats or [None]:
        banks = format_banks(fmt, spec.hidden_size, spec.moe_intermediate_size, args.experts) if fmt else None
        for n in threads:
            row = {"threads": n, "read_GBps": round(on_thread(n, read_bandwidth, args.read_bytes, 5), 1)}
            if banks is None:
                gbps, us = on_thread(
                    n,
                    expert_bandwidth,
                    spec.hidden_size,
                    spec.moe_intermediate_size,
                    args.tokens,
                    args.experts,
                    args.repeats,
                )
                row |= {"expert_GBps": round(gbps, 1), "expert_us": round(us, 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            for backend in backends:  # each beside the read bandwidth of the same thread count
                for timed in host_experts_bandwidth(banks, n, args.tokens, args.repeats, backend, args.isa, prefetches):
                    rows.append({"format": fmt, "backend": backend, **row, **timed})
                    print(json.dumps(rows[-1]), flush=True)
        del banks
    result = {
        "config": args.config,
        "hidden": spec.hidden_size,
        "moe_intermediate": spec.moe_intermediate_size,
        "tokens": args.tokens,
        "cpu": _cpu_name(),
        "cores": cores,
        "torch": torch.__version__,
        "rows": rows,
    }
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
