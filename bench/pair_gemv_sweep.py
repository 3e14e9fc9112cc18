"""The decode expert GEMVs (kernels/expert_pair_gemv.py and its quantized twins) over a sweep of tile
shapes (kernels/pair_tiles.py), timed as a decode step runs them: inside a CUDA graph, so that the
figure is the kernels' device time and not their launches. For each expert format and shape (the
Qwen3.6-35B-A3B experts, H 2048 / I 512, and Qwen3-30B-A3B's, I 768), one layer's routed pairs at
1 and 8 tokens: first the gate/up tiles with today's down tiles, then the down tiles behind the best
gate/up. Every candidate's rows are checked against the current tiles' (float32 rounding apart).
The bound: the distinct experts' bytes over the HBM copy bandwidth measured in the same run.

    python3 bench/pair_gemv_sweep.py --out out [--formats bf16,nvfp4,mxfp4,fp8-block]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"35b": (2048, 512), "30b": (2048, 768)}
# candidate (rows, k, warps) per format, for gate/up and for down
CANDIDATES = {
    "bf16": {
        "gate_up": itertools.product((4, 8, 16), (256, 512), (4, 8)),
        "down": itertools.product((16, 32, 64), (128, 256, 512), (4, 8)),
    },
    "nvfp4": {
        "gate_up": itertools.product((4, 8, 16), (16, 32), (2, 4, 8)),
        "down": itertools.product((8, 16, 32), (16, 32), (4, 8)),
    },
    "mxfp4": {  # k in groups of 32: the same inputs a step as nvfp4's
        "gate_up": itertools.product((4, 8, 16), (8, 16), (2, 4, 8)),
        "down": itertools.product((8, 16, 32), (8, 16), (4, 8)),
    },
    "fp8-block": {
        "gate_up": itertools.product((4, 8, 16), (1, 2), (4, 8)),
        "down": itertools.product((8, 16, 32), (1, 2), (4, 8)),
    },
}


def replay_times_us(graph, calls: int, replays: int) -> list[float]:
    """Device µs of one of the `calls` captured in `graph`, for each of `replays` replays (events around each)."""
    import torch

    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return times


def graph_time_us(fn, calls: int = 20, replays: int = 30) -> float:
    """Median device time of one call, `calls` of them captured in one CUDA graph."""
    import torch

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return statistics.median(replay_times_us(graph, calls, replays))


def experts(fmt_name: str, h: int, i: int, slots: int, dev):
    """(w13 view, w2 view, bytes of one expert) for `slots` experts in the format, dummy weights."""
    import torch

    from ferry.services.worker.expert_formats.fp8_block import Fp8BlockExperts
    from ferry.services.worker.expert_formats.mxfp4 import Mxfp4Experts
    from ferry.services.worker.expert_formats.nvfp4 import Nvfp4Experts

    if fmt_name == "bf16":
        w13 = torch.randn(slots, 2 * i, h, device=dev, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(slots, h, i, device=dev, dtype=torch.bfloat16) * 0.02
        return w13, w2, 3 * h * i * 2
    fmt = {"nvfp4": Nvfp4Experts, "mxfp4": Mxfp4Experts, "fp8-block": Fp8BlockExperts}[fmt_name](h, i)
    (s13, d13), (s2, d2) = fmt.row_shapes()
    w13, w2 = torch.zeros(slots, *s13, dtype=d13), torch.zeros(slots, *s2, dtype=d2)
    fmt.fill_dummy_layer(w13, w2, 0, 0)
    w13, w2 = w13.to(dev), w2.to(dev)
    g13, g2 = fmt.gemm_views(w13, w2)
    return g13, g2, w13[0].nbytes + w2[0].nbytes


def main() -> int:
    import torch

    from bench.bandwidth import measure
    from ferry.kernels import pair_tiles
    from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out")
    p.add_argument("--formats", default="bf16,nvfp4,fp8-block")
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hbm = measure(512 << 20)["hbm_copy_GBps"]
    dev = torch.device("cuda")
    k = args.top_k
    results = {"hbm_copy_GBps": hbm, "current": {}, "best": {}, "runs": []}
    for fmt_name in args.formats.split(","):
        current = pair_tiles.TILES[fmt_name]
        results["current"][fmt_name] = dataclasses.asdict(current)
        cases = []
        for shape, (h, i) in SHAPES.items():
            w13, w2, expert_bytes = experts(fmt_name, h, i, args.slots, dev)
            for tokens in (1, 8):
                gen = torch.Generator(device=dev).manual_seed(tokens)
                x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16, generator=gen)
                ids = torch.stack([torch.randperm(args.slots, device=dev, generator=gen)[:k] for _ in range(tokens)])
                weights = torch.softmax(torch.randn(tokens, k, device=dev, generator=gen), -1).to(torch.bfloat16)
                distinct = int(torch.unique(ids).numel())
                cases.append((shape, tokens, x, ids, weights, w13, w2, distinct * expert_bytes / (hbm * 1e9) * 1e6))

        def run(tiles) -> list[float]:
            pair_tiles.TILES[fmt_name] = tiles
            times = []
            for shape, tokens, x, ids, weights, w13, w2, bound_us in cases:
                rows = torch.empty(tokens, k, x.shape[1], device=dev)
                ref = torch.empty_like(rows)
                pair_tiles.TILES[fmt_name] = current
                expert_pair_rows_triton(x, ids, weights, w13, w2, ref)
                pair_tiles.TILES[fmt_name] = tiles
                expert_pair_rows_triton(x, ids, weights, w13, w2, rows)
                if not torch.allclose(rows, ref, rtol=2e-2, atol=1e-3):
                    raise SystemExit(f"{fmt_name} {tiles}: rows differ from the current tiles' on {shape} x{tokens}")
                us = graph_time_us(lambda: expert_pair_rows_triton(x, ids, weights, w13, w2, rows))
                times.append(us)
                results["runs"].append(
                    {
                        "format": fmt_name,
                        "shape": shape,
                        "tokens": tokens,
                        "pairs": tokens * k,
                        "tiles": dataclasses.asdict(tiles),
                        "us": round(us, 2),
                        "bound_us": round(bound_us, 2),
                    }
                )
            return times

        def score(times):  # the 1-token cases weigh as much as the 8-token ones
            return sum(t / c[-1] for t, c in zip(times, cases))

        best, best_times = current, run(current)
        print(
            f"{fmt_name} current {current}: {[round(t, 1) for t in best_times]} us "
            f"(bounds {[round(c[-1], 1) for c in cases]})",
            flush=True,
        )
        for part in ("gate_up", "down"):
            for rows, kk, warps in CANDIDATES[fmt_name][part]:
                tiles = dataclasses.replace(best, **{f"{part}_rows": rows, f"{part}_k": kk, f"{part}_warps": warps})
                if tiles == best:
                    continue
                times = run(tiles)
                if score(times) < score(best_times):
                    best, best_times = tiles, times
                    print(f"{fmt_name} better {tiles}: {[round(t, 1) for t in times]} us", flush=True)
        pair_tiles.TILES[fmt_name] = current
        results["best"][fmt_name] = {
            "tiles": dataclasses.asdict(best),
            "us": best_times,
            "cases": [f"{c[0]} x{c[1]}" for c in cases],
            "bound_us": [c[-1] for c in cases],
        }
        print(f"{fmt_name} best {best}: {[round(t, 1) for t in best_times]} us", flush=True)
    (out / "pair_gemv_sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
