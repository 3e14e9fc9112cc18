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
    "35b": {"deltanet_in": ((12352, 2048), 0.75), "deltanet_out": ((2048, 4096), 0.75),
            "qkv_gated": ((9216, 2048), 0.25), "o_proj": ((2048, 4096), 0.25), "router_shared_gate": ((257, 2048), 1.0)},
}  # fmt: skip
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
    results = {"hbm_copy_GBps": hbm, "win": WIN, "runs": [], "chosen": {}, "summary": {}}
    layer = {}  # "cut xT" -> one decode layer's projections: cuBLAS, the chosen path, the bound
    for cut, shapes in SHAPES.items():
        for name, ((n, k), per_layer) in shapes.items():
            copies = max(2, min(64, L2_BYTES // (n * k * 2)))
            weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            chosen = {}
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
                        raise SystemExit(f"{cut} {name} x{tokens} {tiles}: the GEMV differs from F.linear")
                    return timed(lambda w: dense_gemv_triton(x, w, tiles=tiles))

                row = {"cut": cut, "shape": name, "n": n, "k": k, "tokens": tokens,
                       "bound_us": n * k * 2 / (hbm * 1e9) * 1e6, "cublas_us": timed(lambda w: F.linear(x, w))}  # fmt: skip
                path = "one" if tokens == 1 else "dot"
                if tokens == 16:  # the dot path's tile chosen at 8 tokens, checked at the block's 16
                    best = chosen["dot_tiles"]
                    best = (kernel_us(best), best) if best else (float("inf"), None)
                else:
                    best = (float("inf"), None)
                    for rows, kk, warps, stages in CANDIDATES[path]:
                        if ceil_div(n, rows) < 8 and rows > 4:
                            continue
                        tiles = GemvTiles(rows, kk, warps, stages)
                        us = kernel_us(tiles)
                        if us < best[0]:
                            best = (us, tiles)
                    chosen[f"{path}_tiles"] = best[1] if best[0] < WIN * row["cublas_us"] else None
                    chosen[f"{path}_best"] = best[1]
                if tokens == 16 and chosen["dot_tiles"] and best[0] > row["cublas_us"]:
                    chosen["dot_tiles"] = None  # it wins at 8 tokens but not at 16: cuBLAS for both
                row["best_us"], row["best"] = best[0], best[1] and dataclasses.asdict(best[1])
                results["runs"].append(row)
                print(f"{cut} {name:18s} [{n}x{k}] x{tokens:2d}: cublas {row['cublas_us']:6.2f}  kernel {best[0]:6.2f} "
                      f"{best[1]}  bound {row['bound_us']:5.2f} us", flush=True)  # fmt: skip
            for tokens in TOKENS:  # the layer's time on the path each token count takes
                row = next(r for r in results["runs"][::-1] if r["n"] == n and r["k"] == k and r["tokens"] == tokens)
                took = chosen["one_tiles" if tokens == 1 else "dot_tiles"]
                acc = layer.setdefault(f"{cut} x{tokens}", {"cublas_us": 0.0, "chosen_us": 0.0, "bound_us": 0.0})
                acc["cublas_us"] += per_layer * row["cublas_us"]
                acc["chosen_us"] += per_layer * (row["best_us"] if took else row["cublas_us"])
                acc["bound_us"] += per_layer * row["bound_us"]
            results["chosen"][f"{n}x{k}"] = [t and dataclasses.asdict(t) for t in (chosen["one_tiles"], chosen["dot_tiles"])]
            del weights
            torch.cuda.empty_cache()
    results["summary"] = {key: {k: round(v, 2) for k, v in acc.items()} for key, acc in layer.items()}
    for key, acc in results["summary"].items():
        print(f"one decode layer's projections, {key}: {acc}")
    (out / "dense_gemv_sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
