"""Decode through the expert offload cache at real shapes, against the bandwidth bound.

For a model's config.json: host banks with dummy weights (seeded), a slot pool sized by the
planner for a device budget (default `--gpu-memory 24GiB`, as a user emulating a 24 GiB card
gets), then N decode steps whose routing is drawn per MoE layer from a seeded Zipf-like
popularity (a random expert ranking per layer, p(rank r) ~ 1 / r^s, k distinct experts per token).
Only the expert path is timed: every MoE layer's `store.forward` for every step.

Measured: pinned host->device bandwidth (one large block, and expert by expert as misses are
copied), HBM bandwidth (device-to-device copy, read + write bytes), the expert GEMM alone with
every expert resident, and per step: time, hits/misses, bytes copied, copy time and the copy
time the compute stream waited for. The bound per step is

    missed bytes / H2D bandwidth + bytes of the routed experts read / HBM bandwidth

(the time a perfect implementation could not beat with this routing and this cache). CUDA
events, warm-up steps, medians. Prints a table, writes JSON (--out), and checks itself: the
store's outputs against the reference computed straight from the host banks, and cached slots
against their banks. Runs on CPU too (tiny configs; "H2D" is then a host memcpy).

    python bench/offload_decode.py --model tests/data/models/qwen3-30b-a3b --gpu-memory 24GiB \
        --batch 1,8,32 --zipf 0.8,1.2 --tokens 256 --out bench/results/offload_decode_qwen3-30b.json

Each (policy, batch, zipf) is one run with a fresh cache over the same banks and slot pool
(e.g. --policy lru,lfu).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ferry.kernels.grouped_expert_gemm import grouped_expert_forward  # noqa: E402
from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_forward_reference  # noqa: E402
from ferry.plan import pool_layout as L  # noqa: E402
from ferry.plan.costs import resident_weight_bytes_from_shapes, workspace_bytes_estimate  # noqa: E402
from ferry.plan.model_config import load_model_config  # noqa: E402
from ferry.plan.planner import Measured, PlanRequest, make_plan  # noqa: E402
from ferry.services.worker.device import select_device  # noqa: E402
from ferry.services.worker.offload.host_memory.host_banks import HostBanks  # noqa: E402
from ferry.services.worker.offload.stores.build import POLICIES, make_policy  # noqa: E402
from ferry.services.worker.offload.stores.offloaded import OffloadedExperts  # noqa: E402
from ferry.services.worker.pools import ExpertSlotPool, allocate_pool  # noqa: E402
from ferry.shared.units import parse_bytes  # noqa: E402


class Clock:
    """Milliseconds of a piece of work: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time_ms(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def median_ms(self, fn, repeat: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            self.time_ms(fn)
        return statistics.median(self.time_ms(fn) for _ in range(repeat))


def measure_bandwidths(banks: HostBanks, device: torch.device, clock: Clock, hbm_bytes: int) -> dict:
    """GB/s (1e9 B/s): H2D of one bank block, H2D expert by expert, HBM copy (read + write)."""
    src13, src2 = banks.w13[0], banks.w2[0]
    dst13, dst2 = torch.empty_like(src13, device=device), torch.empty_like(src2, device=device)
    block_ms = clock.median_ms(lambda: dst13.copy_(src13, non_blocking=True), repeat=5)
    n = min(banks.num_experts, 64)

    def per_expert():
        for e in range(n):
            dst13[e].copy_(src13[e], non_blocking=True)
            dst2[e].copy_(src2[e], non_blocking=True)

    expert_ms = clock.median_ms(per_expert, repeat=5)
    dst13 = dst2 = None  # frees them (the timed closures read them)
    a = torch.empty(hbm_bytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    hbm_ms = clock.median_ms(lambda: b.copy_(a), repeat=10)
    a = b = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "h2d_block_GBps": src13.nbytes / block_ms / 1e6,
        "h2d_block_bytes": src13.nbytes,
        "h2d_per_expert_GBps": n * banks.expert_nbytes / expert_ms / 1e6,
        "h2d_pinned": banks.pinned,
        "hbm_copy_GBps": 2 * hbm_bytes / hbm_ms / 1e6,
        "hbm_copy_bytes": hbm_bytes,
    }


def zipf_routing(
    num_layers: int,
    num_experts: int,
    top_k: int,
    steps: int,
    batch: int,
    exponent: float,
    seed: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [steps, layers, batch, k] (distinct per token) and normalised weights, drawn up front."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
    popularity = ranks**-exponent
    ids = torch.empty(steps, num_layers, batch, top_k, dtype=torch.int64)
    for layer in range(num_layers):
        p = torch.empty(num_experts, dtype=torch.float64)
        p[torch.randperm(num_experts, generator=g)] = popularity  # a random expert ranking per layer
        draws = torch.multinomial(p.expand(steps * batch, -1), top_k, replacement=False, generator=g)
        ids[:, layer] = draws.view(steps, batch, top_k)
    weights = torch.softmax(torch.randn(steps, num_layers, batch, top_k, generator=g), dim=-1)
    return ids.to(device), weights.to(device)


def self_check(store: OffloadedExperts, banks: HostBanks, ids, weights, x, device, exact: bool) -> dict:
    """The store against the reference computed from the host banks, and slot contents."""
    worst = 0.0
    for layer in range(min(banks.num_layers, 4)):
        got = store.forward(layer, x, ids[layer], weights[layer])
        experts = torch.unique(ids[layer]).tolist()
        local = {e: i for i, e in enumerate(experts)}
        w13 = torch.stack([banks.w13[layer][e] for e in experts]).to(device)
        w2 = torch.stack([banks.w2[layer][e] for e in experts]).to(device)
        local_ids = ids[layer].cpu().apply_(lambda e: local[e]).to(device)
        want = grouped_expert_forward_reference(x, local_ids, weights[layer], w13, w2)
        if exact and not torch.equal(got, want):
            raise AssertionError(f"MoE layer {layer}: the store's output differs from the reference")
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()
        worst = max(worst, err)
    store.end_step()
    if worst > 2e-2:
        raise AssertionError(f"the store's output is off the reference by {worst:.3g} (relative max error)")
    policy = store.policy
    occupied = [s for s in range(policy.num_slots) if policy.layer_of_slot[s] >= 0]
    for s in occupied[:: max(1, len(occupied) // 16)]:
        layer, e = int(policy.layer_of_slot[s]), int(policy.expert_of_slot[s])
        if not (
            torch.equal(store.slots.w13[s].cpu(), banks.w13[layer][e])
            and torch.equal(store.slots.w2[s].cpu(), banks.w2[layer][e])
        ):
            raise AssertionError(f"slot {s} does not hold MoE layer {layer} expert {e}")
    return {"passed": True, "max_relative_error": worst, "exact": exact}


def compute_only_ms(
    store: OffloadedExperts, weights: torch.Tensor, x: torch.Tensor, clock: Clock, g: torch.Generator
) -> float:
    """One step of the expert GEMM with every routed expert resident (random distinct slots per
    token): the compute floor, without policy, copies or host round trips."""
    layers, batch, top_k = weights.shape[0], x.shape[0], weights.shape[2]
    num_slots = store.slots.num_slots
    slot_ids = torch.stack(
        [torch.stack([torch.randperm(num_slots, generator=g)[:top_k] for _ in range(batch)]) for _ in range(layers)]
    ).to(x.device)
    slots = store.slots
    return clock.median_ms(
        lambda: [grouped_expert_forward(x, slot_ids[i], weights[i], slots.w13, slots.w2) for i in range(layers)],
        repeat=5,
    )


def decode_run(
    store: OffloadedExperts,
    banks: HostBanks,
    spec,
    args,
    batch: int,
    zipf: float,
    clock: Clock,
    h2d_Bps: float,
    hbm_Bps: float,
) -> dict:
    policy = store.policy.name
    """Warm-up then timed decode steps with fresh cache state; per-step numbers and their medians."""
    device, layers = store.device, banks.num_layers
    steps = args.warmup + args.tokens
    ids, weights = zipf_routing(
        layers, banks.num_experts, spec.num_experts_per_tok, steps + 1, batch, zipf, args.seed, device
    )
    g = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(batch, spec.hidden_size, generator=g).to(device=device, dtype=banks.dtype)
    floor_ms = compute_only_ms(store, weights[0], x, clock, g)
    store.preload()
    rows = []
    for step in range(steps):

        def one_step():
            for layer in range(layers):
                store.forward(layer, x, ids[step, layer], weights[step, layer])

        ms = clock.time_ms(one_step)
        store.end_step()
        c = store.stats.last_step
        # bytes the GEMM reads from HBM: every routed expert of every layer, once
        read = sum(len(torch.unique(ids[step, layer])) for layer in range(layers)) * banks.expert_nbytes
        if step >= args.warmup:
            rows.append(
                {
                    "ms": ms,
                    "hits": c.hits,
                    "misses": c.misses,
                    "bytes_copied": c.bytes_copied,
                    "bytes_read": read,
                    "copy_ms": c.copy_time_s * 1e3,
                    "exposed_copy_ms": c.exposed_copy_time_s * 1e3,
                    "bound_ms": (c.bytes_copied / h2d_Bps + read / hbm_Bps) * 1e3,
                }
            )
    check = {"passed": None}
    if not args.no_check:
        check = self_check(store, banks, ids[steps], weights[steps], x, device, exact=device.type == "cpu")

    def med(key):
        return statistics.median(r[key] for r in rows)

    hits, misses = sum(r["hits"] for r in rows), sum(r["misses"] for r in rows)
    ms_sorted = sorted(r["ms"] for r in rows)
    return {
        "policy": policy,
        "batch": batch,
        "zipf": zipf,
        "steps": len(rows),
        "warmup_steps": args.warmup,
        "median_ms_per_step": med("ms"),
        "p10_ms_per_step": ms_sorted[len(ms_sorted) // 10],
        "p90_ms_per_step": ms_sorted[(len(ms_sorted) * 9) // 10],
        "median_ms_per_token": med("ms") / batch,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "misses_per_step": misses / len(rows),
        "bytes_copied_per_token": sum(r["bytes_copied"] for r in rows) / len(rows) / batch,
        "bytes_read_per_step": med("bytes_read"),
        "median_copy_ms_per_step": med("copy_ms"),
        "median_exposed_copy_ms_per_step": med("exposed_copy_ms"),
        "median_bound_ms_per_step": med("bound_ms"),
        "measured_over_bound": med("ms") / med("bound_ms") if med("bound_ms") > 0 else None,
        "compute_only_ms_per_step": floor_ms,
        "expert_cache": store.report(),
        "check": check,
    }


def run(args: argparse.Namespace) -> dict:
    device = select_device(args.device)
    clock = Clock(device)
    spec = load_model_config(args.model)
    dtype = args.dtype or spec.dtype
    layers, experts = len(spec.moe_layer_indices), spec.num_experts

    # ---- the plan a user of --gpu-memory gets: slots as the worker would size them -------
    req = PlanRequest(
        gpu_memory=parse_bytes(args.gpu_memory),
        max_model_len=args.max_model_len,
        moe_cache_size=args.moe_cache_size,
        dtype=dtype,
    )
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    max_len = args.max_model_len or spec.max_position_embeddings
    measured = Measured(
        resident_weight_bytes_from_shapes(spec, dtype),
        workspace_bytes_estimate(spec, dtype, 8192, 64, max_len),
        free,
        "shapes",
        "estimate",
    )
    plan = make_plan(spec, req, measured)
    slots = ExpertSlotPool(allocate_pool(L.expert_slot_layout(spec, dtype, plan.experts.slots), device))

    banks = HostBanks.for_model(spec, dtype, pin=device.type == "cuda" and not args.no_pin, progress=not args.quiet)
    start = time.perf_counter()
    banks.fill_dummy(seed=args.seed, progress=not args.quiet)
    fill_s = time.perf_counter() - start
    bw = measure_bandwidths(banks, device, clock, args.hbm_bytes or (2**30 if device.type == "cuda" else 2**26))

    runs = []
    for policy, batch, zipf in ((p, b, z) for p in args.policy for b in args.batch for z in args.zipf):
        store = OffloadedExperts(slots, banks, make_policy(policy, layers, experts, plan.experts.slots), device)
        runs.append(
            decode_run(
                store, banks, spec, args, batch, zipf, clock, bw["h2d_per_expert_GBps"] * 1e9, bw["hbm_copy_GBps"] * 1e9
            )
        )
    return {
        "bench": "offload_decode",
        "model": str(args.model),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": {
            "arch": spec.arch,
            "moe_layers": layers,
            "num_experts": experts,
            "top_k": spec.num_experts_per_tok,
            "hidden_size": spec.hidden_size,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "dtype": dtype,
            "expert_bytes": banks.expert_nbytes,
            "host_bank_bytes": banks.nbytes,
        },
        "plan": {
            "gpu_memory": args.gpu_memory,
            "slots": plan.experts.slots,
            "total_experts": plan.experts.total,
            "cache_fraction": plan.experts.slots / plan.experts.total,
            "slot_pool_bytes": plan.experts.bytes,
            "kv_tokens": plan.kv.tokens,
        },
        "routing": {"distribution": "zipf", "seed": args.seed},
        "dummy_fill_s": fill_s,
        "bandwidth": bw,
        "bound_formula": "bytes_copied / h2d_per_expert_GBps + bytes_read (routed experts) / hbm_copy_GBps",
        "runs": runs,
    }


def table(r: dict) -> str:
    b, p = r["bandwidth"], r["plan"]
    head = [
        ("model", f"{r['model']} ({r['config']['arch']}, {r['config']['dtype']}) on {r['device']}"),
        (
            "expert slots",
            f"{p['slots']} / {p['total_experts']} ({100 * p['cache_fraction']:.1f}%) "
            f"for --gpu-memory {p['gpu_memory']}",
        ),
        (
            f"H2D {'pinned' if b['h2d_pinned'] else 'pageable'}, block / per expert",
            f"{b['h2d_block_GBps']:.1f} / {b['h2d_per_expert_GBps']:.1f} GB/s",
        ),
        ("HBM copy (read+write)", f"{b['hbm_copy_GBps']:.0f} GB/s"),
    ]
    width = max(len(k) for k, _ in head)
    lines = [f"{k:<{width}}  {v}" for k, v in head]
    cols = (
        "policy",
        "batch",
        "zipf",
        "ms/step",
        "p10-p90",
        "bound",
        "x bound",
        "GEMM only",
        "hit rate",
        "misses",
        "MiB/token",
        "copy ms",
        "exposed",
        "check",
    )
    lines.append("  ".join(f"{c:>9}" for c in cols))
    for d in r["runs"]:
        ratio = d["measured_over_bound"]
        cells = (
            d["policy"],
            d["batch"],
            d["zipf"],
            f"{d['median_ms_per_step']:.3f}",
            f"{d['p10_ms_per_step']:.1f}-{d['p90_ms_per_step']:.1f}",
            f"{d['median_bound_ms_per_step']:.3f}",
            f"{ratio:.2f}" if ratio else "-",
            f"{d['compute_only_ms_per_step']:.3f}",
            f"{100 * d['hit_rate']:.1f}%",
            f"{d['misses_per_step']:.1f}",
            f"{d['bytes_copied_per_token'] / 2**20:.1f}",
            f"{d['median_copy_ms_per_step']:.3f}",
            f"{d['median_exposed_copy_ms_per_step']:.3f}",
            "passed" if d["check"]["passed"] else "skipped",
        )
        lines.append("  ".join(f"{c!s:>9}" for c in cells))
    return "\n".join(lines)


def _list_of(kind):
    def parse(text: str) -> list:
        return [kind(v) for v in text.split(",") if v.strip()]

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="directory holding config.json")
    ap.add_argument("--gpu-memory", default="24GiB", help="device budget given to the planner (default 24GiB)")
    ap.add_argument("--max-model-len", type=int, default=None, help="planner flag (KV floor); default the model's")
    ap.add_argument("--moe-cache-size", type=int, default=None, help="fix the number of expert slots")
    ap.add_argument("--dtype", default=None, help="default: the checkpoint's")
    ap.add_argument("--tokens", type=int, default=256, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=32, help="untimed decode steps first (the cache warms)")
    ap.add_argument(
        "--batch", type=_list_of(int), default=[1], help="tokens per decode step; a list runs each, e.g. 1,8,32"
    )
    ap.add_argument(
        "--zipf",
        type=_list_of(float),
        default=[1.0],
        help="popularity exponent s, p(rank r) ~ 1/r^s; a list runs each, e.g. 0.6,1.0,1.4",
    )
    ap.add_argument(
        "--policy",
        type=_list_of(str),
        default=["lru", "lfu"],
        help=f"expert cache policy ({', '.join(POLICIES)}); a list runs each, e.g. lru,lfu",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto")
    ap.add_argument("--hbm-bytes", type=int, default=None, help="size of the device copy that measures HBM")
    ap.add_argument("--no-pin", action="store_true", help="pageable host banks (to see what pinning buys)")
    ap.add_argument("--no-check", action="store_true", help="skip the self-check")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    unknown = [p for p in args.policy if p not in POLICIES]
    if unknown:
        ap.error(f"unknown --policy {unknown}; choose from {', '.join(POLICIES)}")
    if args.tokens < 1 or args.warmup < 0 or min(args.batch) < 1 or min(args.zipf) < 0:
        ap.error("--tokens and --batch must be at least 1, --warmup and --zipf not negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
