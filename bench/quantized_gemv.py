"""The decode expert GEMV (kernels/expert_pair_gemv.py and its quantized twins, kernels/quantized_expert_gemv.py)
at Qwen3.6-35B-A3B shapes (H 2048, I 512), one layer's routed pairs: bf16 slots against NVFP4 and
FP8-block ones, and a few tile shapes of the quantized kernels. The bound is the bytes of the
distinct experts read over the HBM copy bandwidth measured in the same run (bench/bandwidth.py).

    python3 bench/quantized_gemv.py --out out
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _time(fn, reps: int = 200) -> float:
    import torch

    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    import torch

    from bench.bandwidth import measure
    from ferry.kernels import quantized_expert_gemv as Q
    from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton
    from ferry.services.worker.expert_formats.fp8_block import Fp8BlockExperts
    from ferry.services.worker.expert_formats.nvfp4 import Nvfp4Experts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out")
    p.add_argument("--slots", type=int, default=256)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hbm = measure(512 << 20)["hbm_copy_GBps"]
    h, i, k, slots = 2048, 512, 8, args.slots
    dev = torch.device("cuda")
    formats = {"bf16": None, "nvfp4": Nvfp4Experts(h, i), "fp8-block": Fp8BlockExperts(h, i)}
    results = {"hbm_copy_GBps": hbm, "hidden": h, "inter": i, "runs": []}
    defaults = (Q.GATE_UP_BLOCK_N, Q.DOWN_BLOCK_N, Q.NVFP4_GROUPS_PER_STEP)
    for name, fmt in formats.items():
        if fmt is None:
            w13 = torch.randn(slots, 2 * i, h, device=dev, dtype=torch.bfloat16) * 0.02
            w2 = torch.randn(slots, h, i, device=dev, dtype=torch.bfloat16) * 0.002
            g13, g2, expert_bytes = w13, w2, 3 * h * i * 2
        else:
            (s13, d13), (s2, d2) = fmt.row_shapes()
            w13, w2 = torch.zeros(slots, *s13, dtype=d13), torch.zeros(slots, *s2, dtype=d2)
            fmt.fill_dummy_layer(w13, w2, 0, 0)
            w13, w2 = w13.to(dev), w2.to(dev)
            g13, g2 = fmt.gemm_views(w13, w2)
            expert_bytes = w13[0].nbytes + w2[0].nbytes
        tiles = [defaults] if fmt is None else [defaults, (8, 16, 16), (16, 16, 8), (32, 64, 16), (8, 32, 8)]
        for tokens in (1, 8):
            x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(slots, device=dev)[:k] for _ in range(tokens)]).to(torch.int32)
            weights = torch.softmax(torch.randn(tokens, k, device=dev), -1)
            rows = torch.empty(tokens, k, h, device=dev)
            distinct = int(torch.unique(ids).numel())
            for tile in tiles:
                Q.GATE_UP_BLOCK_N, Q.DOWN_BLOCK_N, Q.NVFP4_GROUPS_PER_STEP = tile
                seconds = _time(lambda: expert_pair_rows_triton(x, ids, weights, g13, g2, rows))
                bound = distinct * expert_bytes / (hbm * 1e9)
                run = {"format": name, "tokens": tokens, "pairs": tokens * k, "distinct_experts": distinct,
                       "tile": list(tile), "median_us": seconds * 1e6, "bound_us": bound * 1e6,
                       "GBps": distinct * expert_bytes / seconds / 1e9}  # fmt: skip
                results["runs"].append(run)
                print(f"{name:9s} tokens {tokens} tile {tile}: {run['median_us']:.1f} us (bound {run['bound_us']:.1f}), "
                      f"{run['GBps']:.0f} GB/s", flush=True)  # fmt: skip
        Q.GATE_UP_BLOCK_N, Q.DOWN_BLOCK_N, Q.NVFP4_GROUPS_PER_STEP = defaults
    (out / "quantized_gemv.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
