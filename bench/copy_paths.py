"""How a missed expert should cross PCIe: copy engine (cudaMemcpyAsync from the host) or the GPU's
own cores reading mapped pinned memory (kernels/expert_copy.py, a miss list held on the device).

For one MoE layer's host bank of a model's shapes (default Qwen3-30B-A3B: 9.44 MB per expert),
N missed experts (1, 6, 40: a single-stream layer, an 8-stream layer) are copied into random
slots, each repetition other experts (the banks are far larger than L2). Reported per variant
(the copy engine from one stream, spread over several, beside the copy kernel; the copy kernel's
grid and block): median time and GB/s, next to cudaMemcpy's bandwidth for one large block. Then:

* the copy kernel captured in a CUDA graph and replayed with new miss lists (it must copy
  exactly what the device-held list says: checked byte for byte);
* overlap: the copy kernel on a side stream while the expert GEMV of the layer's hits runs on
  the main stream, each timed alone and together.

    python3 bench/copy_paths.py --config tests/data/models/qwen3-30b-a3b/config.json --out copy_paths.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferry.kernels.expert_copy import copy_experts_triton  # noqa: E402
from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton  # noqa: E402
from ferry.plan.model_config import load_model_config  # noqa: E402
from ferry.services.worker.device import select_device  # noqa: E402
from ferry.services.worker.offload.host_memory.host_banks import HostBanks  # noqa: E402


def timed(fn, reps: int, setup=None) -> list[float]:
    """Milliseconds of `fn` per repetition (CUDA events), after 3 warm-ups; `setup(i)` before each, untimed."""
    out = []
    for i in range(reps + 3):
        if setup is not None:
            setup(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 3:
            out.append(start.elapsed_time(end))
    return out


def layer_bench_setup(doc: str):
    """The flags of a one-layer copy benchmark (--config, --reps, --out), parsed: (args, device, spec)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tests/data/models/qwen3-30b-a3b/config.json")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    return args, select_device("cuda"), load_model_config(Path(args.config).parent)


def main() -> int:
    args, device, spec = layer_bench_setup(__doc__)
    banks = HostBanks.allocate(
        2, spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, torch.bfloat16, pin=True, progress=False
    )
    banks.fill_dummy(seed=1, progress=False)
    e, slots_n = spec.num_experts, 256
    w13 = torch.empty((slots_n, *banks.w13[0].shape[1:]), dtype=torch.bfloat16, device=device)
    w2 = torch.empty((slots_n, *banks.w2[0].shape[1:]), dtype=torch.bfloat16, device=device)
    expert_bytes = banks.expert_nbytes
    g = torch.Generator().manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(device), "expert_bytes": expert_bytes, "runs": []}

    big = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    big_dev = torch.empty_like(big, device=device)
    ms = statistics.median(timed(lambda: big_dev.copy_(big, non_blocking=True), 10))
    results["memcpy_1GiB_GBps"] = (1 << 30) / ms / 1e6
    big = big_dev = None  # frees them (the timed lambda read them)
    print(f"cudaMemcpy pinned H2D, 1 GiB: {results['memcpy_1GiB_GBps']:.1f} GB/s; expert {expert_bytes / 1e6:.2f} MB")

    misses = torch.zeros(64, 2, dtype=torch.int32, device=device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    count_rest = torch.zeros(1, dtype=torch.int32, device=device)  # the copy kernel's half in ce_beside_sm
    plan: dict = {}

    def choose(n: int, i: int) -> None:
        layer = i % 2
        experts = torch.randperm(e, generator=g)[:n]
        slots = torch.randperm(slots_n, generator=g)[:n]
        plan.update(layer=layer, pairs=list(zip(experts.tolist(), slots.tolist())))
        misses[:n].copy_(torch.stack([experts, slots], 1).to(torch.int32))
        count.fill_(n)
        count_rest.fill_(n - n // 2)
        torch.cuda.synchronize()

    def ce() -> None:
        layer = plan["layer"]
        for ex, s in plan["pairs"]:
            w13[s].copy_(banks.w13[layer][ex], non_blocking=True)
            w2[s].copy_(banks.w2[layer][ex], non_blocking=True)

    copy_streams = [torch.cuda.Stream(device) for _ in range(4)]

    def ce_spread(streams: int, by_family: bool = False):
        """Copy-engine copies spread over `streams` side streams, expert by expert (or w13 on one, w2
        on the other): a copy can start while the one before it drains."""

        def run() -> None:
            layer, here = plan["layer"], torch.cuda.current_stream()
            for st in copy_streams[:streams]:
                st.wait_stream(here)
            for i, (ex, s) in enumerate(plan["pairs"]):
                with torch.cuda.stream(copy_streams[0 if by_family else i % streams]):
                    w13[s].copy_(banks.w13[layer][ex], non_blocking=True)
                with torch.cuda.stream(copy_streams[1 if by_family else i % streams]):
                    w2[s].copy_(banks.w2[layer][ex], non_blocking=True)
            for st in copy_streams[:streams]:
                here.wait_stream(st)

        return run

    def ce_beside_sm() -> None:
        """Half the experts by the copy engine, half by the copy kernel on a side stream, at once."""
        layer, here, pairs = plan["layer"], torch.cuda.current_stream(), plan["pairs"]
        half = len(pairs) // 2
        side = copy_streams[3]
        side.wait_stream(here)
        with torch.cuda.stream(side):  # the kernel copies the list's rows from `half` on
            copy_experts_triton(
                banks.w13[layer], banks.w2[layer], w13, w2, misses[half:], count_rest, programs=32, block=4096
            )
        for ex, s in pairs[:half]:
            w13[s].copy_(banks.w13[layer][ex], non_blocking=True)
            w2[s].copy_(banks.w2[layer][ex], non_blocking=True)
        here.wait_stream(side)

    def sm(programs: int, block: int):
        return lambda: copy_experts_triton(
            banks.w13[plan["layer"]], banks.w2[plan["layer"]], w13, w2, misses, count, programs=programs, block=block
        )

    variants = [
        ("copy engine", ce),
        ("copy engine, 2 streams", ce_spread(2)),
        ("copy engine, 4 streams", ce_spread(4)),
        ("copy engine, w13 | w2", ce_spread(2, by_family=True)),
        ("copy engine + SM, halves", ce_beside_sm),
    ] + [(f"SM P={pr} B={bl}", sm(pr, bl)) for pr in (8, 16, 32, 64, 132) for bl in (2048, 4096, 8192)]
    print(f"{'variant':<22}" + "".join(f"{f'{n} experts':>22}" for n in (1, 6, 40)))
    for name, fn in variants:
        row = {"variant": name}
        cells = []
        for n in (1, 6, 40):
            t = timed(fn, args.reps, setup=lambda i, n=n: choose(n, i))
            med = statistics.median(t)
            row[str(n)] = {"median_ms": med, "GBps": n * expert_bytes / med / 1e6}
            cells.append(f"{med:8.3f} ms {row[str(n)]['GBps']:6.1f} GB/s")
        results["runs"].append(row)
        print(f"{name:<22}" + "".join(f"{c:>22}" for c in cells))

    # the copy kernel inside a CUDA graph, replayed for new device-held miss lists
    graph_ok = True
    try:
        stream = torch.cuda.Stream(device)
        choose(6, 0)
        sm(32, 4096)()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        layer_for_graph = 0
        with torch.cuda.graph(graph, stream=stream):
            copy_experts_triton(
                banks.w13[layer_for_graph], banks.w2[layer_for_graph], w13, w2, misses, count, programs=32, block=4096
            )
        for i, n in enumerate((6, 1, 40, 0, 17)):
            w13.fill_(0)
            w2.fill_(0)
            choose(n, 2 * i)  # even i: layer 0, the graph's layer
            graph.replay()
            torch.cuda.synchronize()
            for ex, s in plan["pairs"]:
                graph_ok &= torch.equal(w13[s].cpu(), banks.w13[0][ex]) and torch.equal(w2[s].cpu(), banks.w2[0][ex])
            if n == 0:
                graph_ok &= bool((w13 == 0).all())
        t = timed(graph.replay, args.reps, setup=lambda i: choose(6, 2 * i))
        results["graph_replay_6_experts_ms"] = statistics.median(t)
    except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
        graph_ok = f"{type(exc).__name__}: {exc}"
    results["graph_copy_correct"] = graph_ok
    print(
        f"copy kernel in a CUDA graph, replayed for 5 new miss lists: {graph_ok}; "
        f"6 experts {results.get('graph_replay_6_experts_ms', float('nan')):.3f} ms"
    )

    # overlap: copy (side stream) beside the hits' expert GEMV (main stream)
    x = torch.randn(1, spec.hidden_size, device=device).to(torch.bfloat16)
    hit_slots = torch.randint(0, slots_n, (1, spec.num_experts_per_tok), device=device, dtype=torch.int32)
    weights = torch.rand(1, spec.num_experts_per_tok, device=device)
    rows = torch.empty(1, spec.num_experts_per_tok, spec.hidden_size, dtype=torch.float32, device=device)
    gemv = lambda: expert_pair_rows_triton(x, hit_slots, weights, w13, w2, rows)  # noqa: E731
    side = torch.cuda.Stream(device)
    overlap = {}
    for programs in (16, 32, 64):
        copy = sm(programs, 4096)

        def both(copy=copy):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy()
            gemv()
            torch.cuda.current_stream().wait_stream(side)

        alone_copy = statistics.median(timed(copy, args.reps, setup=lambda i: choose(6, i)))
        alone_gemv = statistics.median(timed(gemv, args.reps))
        together = statistics.median(timed(both, args.reps, setup=lambda i: choose(6, i)))
        overlap[programs] = {"copy_ms": alone_copy, "gemv_ms": alone_gemv, "together_ms": together}
        print(
            f"overlap P={programs}: copy 6 experts {alone_copy:.3f} ms, hits' GEMV {alone_gemv:.3f} ms, "
            f"both {together:.3f} ms"
        )
    results["overlap"] = overlap
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
