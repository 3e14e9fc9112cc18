"""The decode projections' GEMV (kernels/dense_gemv.py) against cuBLAS (F.linear) on the shapes of the
bench models' layers, at 1, 8 and 16 tokens, over a sweep of tiles. Timed as a decode step runs
them: inside a CUDA graph, the calls cycling over enough copies of the weight that none is read
from L2 (a step reads each layer's weights once). Every candidate's output is checked against
F.linear's (bf16 rounding apart). The bound: the weight's bytes over the HBM copy bandwidth measured
in the same run. A shape's `chosen` tiles (one token; 2-16 tokens) are its best where that beat
cuBLAS by 3 %, else null (cuBLAS): what kernels/dense_gemv.py's TILES holds, and what
FERRY_DENSE_GEMV_TILES=<this JSON> makes a server run. Per cut, the summary adds one decode layer's
projections on cuBLAS and on the chosen paths.

    python3 bench/dense_gemv_sweep.py --out out
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.pair_gemv_sweep import graph_time_us  # noqa: E402

# (N, K) of each projection a decode layer runs, and how many of it a layer of the cut has on average
SHAPES = {
    "30b": {"qkv": ((5120, 2048), 1.0), "o_proj": ((2048, 4096), 1.0), "router": ((128, 2048), 1.0)},
    # the hybrid cut: 6 Gated DeltaNet layers and 2 attention layers in 8, every layer a MoE block
    "35b": {
        "deltanet_in": ((12352, 2048), 0.75),
        "deltanet_out": ((2048, 4096), 0.75),
        "qkv_gated": ((9216, 2048), 0.25),
        "o_proj": ((2048, 4096), 0.25),
        "router_shared_gate": ((257, 2048), 1.0),
    },
}
TOKENS = (1, 8, 16)  # one token; the dot path chosen at 8 and checked at 16
CANDIDATES = {  # (rows, k, warps, stages)
    "one": list(itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (1, 3))),
    "dot": list(itertools.product((16, 32, 64), (128, 256), (4,), (2, 4))),
}
L2_BYTES = 256 << 20  # copies of a weight until the cycle spans this much (the H200's L2 is 50 MB)
WIN = 0.97  # the kernel takes a shape where its best is at least 3 % under cuBLAS


def main() -> int:
    import torch
    import torch.nn.functional as F
    from triton.runtime.errors import OutOfResources

    from bench.bandwidth import measure
    from ferry.kernels.dense_gemv import GemvTiles, dense_gemv_triton
    from ferry.shared.units import ceil_div

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hbm = measure(512 << 20)["hbm_copy_GBps"]
    dev = torch.device("cuda")

    def sweep_shape(n: int, k: int, names: str) -> tuple[dict[int, dict], list]:
        """{tokens: run} and the chosen (one-token, dot) tiles of one [N, K] weight."""
        copies = max(2, min(64, L2_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        runs, chosen = {}, {}
        for tokens in TOKENS:
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
            want = F.linear(x.float(), weights[0].float())

            def timed(fn):  # µs a call, the calls cycling over the copies
                state = {"i": 0}

                def call():
                    fn(weights[state["i"] % copies])
                    state["i"] += 1

                return graph_time_us(call, calls=copies)

            def kernel_us(tiles):
                try:
                    got = dense_gemv_triton(x, weights[0], tiles=tiles)
                except OutOfResources:  # more shared memory than an SM has: not a candidate
                    return float("inf")
                if not torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                    raise SystemExit(f"{names} x{tokens} {tiles}: the GEMV differs from F.linear")
                return timed(lambda w: dense_gemv_triton(x, w, tiles=tiles))

            row = {
                "shape": names,
                "n": n,
                "k": k,
                "tokens": tokens,
                "bound_us": n * k * 2 / (hbm * 1e9) * 1e6,
                "cublas_us": timed(lambda w: F.linear(x, w)),
            }
            path = "one" if tokens == 1 else "dot"
            if tokens == 16:  # the dot path's tile chosen at 8 tokens, checked at the block's 16
                best = (kernel_us(chosen["dot"]), chosen["dot"]) if chosen["dot"] else (float("inf"), None)
                if chosen["dot"] and best[0] > row["cublas_us"]:
                    chosen["dot"] = None  # it wins at 8 tokens but not at 16: cuBLAS for both
            else:
                best = (float("inf"), None)
                for rows, kk, warps, stages in CANDIDATES[path]:
                    if ceil_div(n, rows) < 8 and rows > 4:
                        continue
                    tiles = GemvTiles(rows, kk, warps, stages)
                    us = kernel_us(tiles)
                    if us < best[0]:
                        best = (us, tiles)
                chosen[path] = best[1] if best[0] < WIN * row["cublas_us"] else None
            row["best_us"], row["best"] = best[0], best[1] and dataclasses.asdict(best[1])
            runs[tokens] = row
            print(
                f"{names:40s} [{n}x{k}] x{tokens:2d}: cublas {row['cublas_us']:6.2f}  kernel {best[0]:6.2f} "
                f"{best[1]}  bound {row['bound_us']:5.2f} us",
                flush=True,
            )
        weights = None  # frees them (the timed closures read them)
        torch.cuda.empty_cache()
        return runs, [chosen["one"], chosen["dot"]]

    # each distinct weight shape once (o_proj and the Gated DeltaNet out_proj are both [2048, 4096])
    names: dict[tuple[int, int], list[str]] = {}
    for cut, shapes in SHAPES.items():
        for name, (shape, _) in shapes.items():
            names.setdefault(shape, []).append(f"{cut} {name}")
    swept = {shape: sweep_shape(*shape, ", ".join(who)) for shape, who in names.items()}
    results = {
        "hbm_copy_GBps": hbm,
        "win": WIN,
        "runs": [row for runs, _ in swept.values() for row in runs.values()],
        "chosen": {f"{n}x{k}": [t and dataclasses.asdict(t) for t in chosen] for (n, k), (_, chosen) in swept.items()},
        "summary": {},
    }
    for cut, shapes in SHAPES.items():  # one decode layer's projections: cuBLAS, the chosen paths, the bound
        for tokens in TOKENS:
            acc = {"cublas_us": 0.0, "chosen_us": 0.0, "bound_us": 0.0}
            for shape, per_layer in shapes.values():
                runs, (one, dot) = swept[shape]
                row = runs[tokens]
                acc["cublas_us"] += per_layer * row["cublas_us"]
                acc["chosen_us"] += per_layer * (row["best_us"] if (one if tokens == 1 else dot) else row["cublas_us"])
                acc["bound_us"] += per_layer * row["bound_us"]
            results["summary"][f"{cut} x{tokens}"] = {key: round(v, 2) for key, v in acc.items()}
    for key, acc in results["summary"].items():
        print(f"one decode layer's projections, {key}: {acc}")
    (out / "dense_gemv_sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
