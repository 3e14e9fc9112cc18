"""The decode projections' GEMV (kernels/dense_gemv.py) against cuBLAS (F.linear) on the shapes of the
bench models' layers, at 1, 4, 8 and 16 tokens, over a sweep of tiles. Timed as a decode step runs
them: inside a CUDA graph, the calls cycling over enough copies of the weight that none is read
from L2 (a step reads each layer's weights once). Every candidate's output is checked against
F.linear's (bf16 rounding apart). The bound: the weight's bytes over the HBM copy bandwidth measured
in the same run. Per cut, the summary adds one decode layer's projections: cuBLAS, the kernel's
table (what `dense_linear` runs) and each shape's best tile.

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
TOKENS = (1, 4, 8, 16)
CANDIDATES = {  # (rows, k, warps)
    "one": list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8))),
    "dot": list(itertools.product((16, 32, 64), (128, 256, 512), (4, 8))),
}
L2_BYTES = 256 << 20  # copies of a weight until the cycle spans this much (the H200's L2 is 50 MB)


def main() -> int:
    import torch
    import torch.nn.functional as F

    from bench.bandwidth import measure
    from ferry.kernels.dense_gemv import TILES, GemvTiles, dense_gemv_triton, tiles_for
    from ferry.shared.units import ceil_div

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hbm = measure(512 << 20)["hbm_copy_GBps"]
    dev = torch.device("cuda")
    results = {"hbm_copy_GBps": hbm, "table": {str(k): dataclasses.asdict(v) for k, v in TILES.items()},
               "runs": [], "summary": {}}  # fmt: skip
    layer = {}  # (cut, tokens) -> {"cublas": us, "table": us, "best": us, "bound": us}
    for cut, shapes in SHAPES.items():
        for name, ((n, k), per_layer) in shapes.items():
            copies = max(2, min(64, L2_BYTES // (n * k * 2)))
            weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for tokens in map(int, args.tokens.split(",")):
                x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
                want = F.linear(x.float(), weights[0].float())
                state = {"i": 0}

                def cycle(fn):
                    def call():
                        fn(weights[state["i"] % copies])
                        state["i"] += 1
                    return call  # fmt: skip

                def timed(tiles):
                    got = dense_gemv_triton(x, weights[0], tiles=tiles)
                    if not torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                        raise SystemExit(f"{cut} {name} x{tokens} {tiles}: the GEMV differs from F.linear")
                    return graph_time_us(cycle(lambda w: dense_gemv_triton(x, w, tiles=tiles)), calls=copies)

                row = {"cut": cut, "shape": name, "n": n, "k": k, "tokens": tokens,
                       "bound_us": n * k * 2 / (hbm * 1e9) * 1e6,
                       "cublas_us": graph_time_us(cycle(lambda w: F.linear(x, w)), calls=copies)}  # fmt: skip
                table = tiles_for(tokens, n)
                row["table"], row["table_us"] = dataclasses.asdict(table), timed(table)
                best = (row["table_us"], table)
                for rows, kk, warps in CANDIDATES["one" if tokens == 1 else "dot"]:
                    tiles = GemvTiles(rows, kk, warps)
                    if ceil_div(n, rows) < 8 or (rows, kk, warps) == (table.rows, table.k, table.warps):
                        continue
                    us = timed(tiles)
                    if us < best[0]:
                        best = (us, tiles)
                row["best_us"], row["best"] = best[0], dataclasses.asdict(best[1])
                results["runs"].append(row)
                print(f"{cut} {name:18s} [{n}x{k}] x{tokens:2d}: cublas {row['cublas_us']:6.2f}  table "
                      f"{row['table_us']:6.2f} ({table.rows}x{table.k}/{table.warps}w)  best {best[0]:6.2f} "
                      f"({best[1].rows}x{best[1].k}/{best[1].warps}w)  bound {row['bound_us']:5.2f} us", flush=True)  # fmt: skip
                acc = layer.setdefault(f"{cut} x{tokens}", {"cublas_us": 0.0, "table_us": 0.0, "best_us": 0.0, "bound_us": 0.0})
                for key in acc:
                    acc[key] += per_layer * row[key]
            del weights
            torch.cuda.empty_cache()
    results["summary"] = {key: {k: round(v, 2) for k, v in acc.items()} for key, acc in layer.items()}
    for key, acc in results["summary"].items():
        print(f"one decode layer's projections, {key}: {acc}")
    (out / "dense_gemv_sweep.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
