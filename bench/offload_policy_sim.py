"""Hit rates of the expert cache policies at real shapes, on CPU in seconds: no weights, no GPU.

Replays decode routing (the same seeded per-layer Zipf popularity as offload_decode.py) through
the pure policies for a planner-sized cache (or --moe-cache-size), and turns misses into the
bandwidth bound per token with the H200's measured numbers (or those of an offload_decode.py
JSON, --bandwidth-from): missed bytes / H2D + routed expert bytes / HBM.

    python bench/offload_policy_sim.py --model tests/data/models/qwen3-30b-a3b --gpu-memory 24GiB \\
        --batch 1,8,32 --zipf 0.8,1.0,1.2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ferry.plan import pool_layout as L  # noqa: E402
from ferry.plan.costs import resident_weight_bytes_from_shapes, workspace_bytes_estimate  # noqa: E402
from ferry.plan.model_config import load_model_config  # noqa: E402
from ferry.plan.planner import Measured, PlanRequest, make_plan  # noqa: E402
from ferry.services.worker.offload.stores.build import POLICIES, make_policy  # noqa: E402
from ferry.shared.units import parse_bytes  # noqa: E402

# H200, PCIe Gen5 pinned host->device and HBM, as measured on the target machine
DEFAULT_H2D_GBPS = 55.0
DEFAULT_HBM_GBPS = 4300.0


def simulate(
    policy_name: str,
    layers: int,
    experts: int,
    top_k: int,
    slots: int,
    batch: int,
    zipf: float,
    steps: int,
    warmup: int,
    seed: int,
) -> dict:
    rng = np.random.default_rng(seed)
    popularity = np.arange(1, experts + 1, dtype=np.float64) ** -zipf
    popularity /= popularity.sum()
    per_layer = [rng.permutation(popularity) for _ in range(layers)]
    policy = make_policy(policy_name, layers, experts, slots)
    hits = misses = routed = 0
    for step in range(warmup + steps):
        for layer in range(layers):
            # k distinct experts per token, drawn by popularity (Gumbel top-k = sampling without replacement)
            keys = np.log(per_layer[layer]) - np.log(-np.log(rng.random((batch, experts))))
            chosen = np.unique(np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k])
            got = policy.lookup(layer, chosen)
            if step >= warmup:
                hits, misses, routed = hits + got.hits, misses + len(got.misses), routed + len(chosen)
    return {
        "policy": policy_name,
        "batch": batch,
        "zipf": zipf,
        "hit_rate": hits / (hits + misses),
        "misses_per_step": misses / steps,
        "routed_per_step": routed / steps,
    }


def run(args: argparse.Namespace) -> dict:
    spec = load_model_config(args.model)
    dtype = args.dtype or spec.dtype
    layers, experts = len(spec.moe_layer_indices), spec.num_experts
    max_len = args.max_model_len or spec.max_position_embeddings
    plan = make_plan(
        spec,
        PlanRequest(
            gpu_memory=parse_bytes(args.gpu_memory),
            max_model_len=args.max_model_len,
            moe_cache_size=args.moe_cache_size,
            dtype=dtype,
        ),
        Measured(
            resident_weight_bytes_from_shapes(spec, dtype), workspace_bytes_estimate(spec, dtype, 8192, 64, max_len)
        ),
    )
    h2d, hbm = DEFAULT_H2D_GBPS, DEFAULT_HBM_GBPS
    if args.bandwidth_from:
        bw = json.loads(Path(args.bandwidth_from).read_text())["bandwidth"]
        h2d, hbm = bw["h2d_per_expert_GBps"], bw["hbm_copy_GBps"]
    expert_bytes = L.expert_bytes(spec, dtype)
    runs = []
    for policy in args.policy:
        for batch in args.batch:
            for zipf in args.zipf:
                r = simulate(
                    policy,
                    layers,
                    experts,
                    spec.num_experts_per_tok,
                    plan.experts.slots,
                    batch,
                    zipf,
                    args.steps,
                    args.warmup,
                    args.seed,
                )
                bound_ms = (
                    r["misses_per_step"] * expert_bytes / (h2d * 1e9)
                    + r["routed_per_step"] * expert_bytes / (hbm * 1e9)
                ) * 1e3
                runs.append(
                    {
                        **r,
                        "bound_ms_per_step": bound_ms,
                        "bound_ms_per_token": bound_ms / batch,
                        "copied_MiB_per_token": r["misses_per_step"] * expert_bytes / batch / 2**20,
                    }
                )
    return {
        "model": str(args.model),
        "slots": plan.experts.slots,
        "total_experts": plan.experts.total,
        "expert_bytes": expert_bytes,
        "h2d_GBps": h2d,
        "hbm_GBps": hbm,
        "runs": runs,
    }


def table(r: dict) -> str:
    lines = [
        f"{r['model']}: {r['slots']} / {r['total_experts']} expert slots; "
        f"bound with H2D {r['h2d_GBps']:g} GB/s, HBM {r['hbm_GBps']:g} GB/s",
        f"{'policy':>6} {'batch':>5} {'zipf':>5} {'hit rate':>9} {'misses/step':>11} {'MiB/token':>9} "
        f"{'bound ms/token':>14}",
    ]
    for d in r["runs"]:
        lines.append(
            f"{d['policy']:>6} {d['batch']:>5} {d['zipf']:>5} {100 * d['hit_rate']:>8.1f}% "
            f"{d['misses_per_step']:>11.1f} {d['copied_MiB_per_token']:>9.1f} {d['bound_ms_per_token']:>14.3f}"
        )
    return "\n".join(lines)


def _list_of(kind):
    return lambda text: [kind(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="directory holding config.json")
    ap.add_argument("--gpu-memory", default="24GiB")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--moe-cache-size", type=int, default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--policy", type=_list_of(str), default=list(POLICIES))
    ap.add_argument("--batch", type=_list_of(int), default=[1, 8, 32])
    ap.add_argument("--zipf", type=_list_of(float), default=[1.0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bandwidth-from", default=None, help="an offload_decode.py JSON: use its measured bandwidths")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = run(args)
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
