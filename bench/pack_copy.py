"""What 12-bit packed experts (kernels/expert_pack.py) buy on the wire: the unpacking copy kernel
against the plain copy kernel (kernels/expert_copy.py) and the copy engine, for one MoE layer of a
model's shapes (default Qwen3-30B-A3B), N missed experts (1, 6, 40) into random slots, each
repetition other experts. Reported per variant: median time, the GB/s of bytes that crossed PCIe
(packed: lo + hi + base + escapes) and the bf16 GB/s it delivers into the slots. Then the unpacking
kernel in a CUDA graph, replayed for new device-held lists, checked bit for bit. Last, the packing
itself (as experts load): its bf16 GB/s and its peak device temporaries a value, against the
PACK_BYTES_PER_VALUE that packed_banks.py sizes its groups by, and the dummy weights' exact zeros.

    python3 bench/pack_copy.py --config tests/data/models/qwen3-30b-a3b/config.json --out pack_copy.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.copy_paths import layer_bench_setup, timed  # noqa: E402
from ferry.kernels.expert_copy import copy_experts_triton  # noqa: E402
from ferry.kernels.expert_pack import pack_experts  # noqa: E402
from ferry.services.worker.offload.host_memory.host_banks import HostBanks  # noqa: E402
from ferry.services.worker.offload.host_memory.packed_banks import (  # noqa: E402
    PACK_BYTES_PER_VALUE,
    PACK_TEMP_BYTES,
    PackedHostBanks,
)


def main() -> int:
    args, device, spec = layer_bench_setup(__doc__)
    shape = (2, spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, torch.bfloat16)
    raw = HostBanks.allocate(*shape, pin=True, progress=False)
    raw.fill_dummy(seed=1, progress=False)
    packed = PackedHostBanks.allocate(*shape, pin=True, progress=False)
    packed.fill_dummy(seed=1, progress=False)
    e, slots_n = spec.num_experts, 256
    w13 = torch.empty((slots_n, *raw.w13[0].shape[1:]), dtype=torch.bfloat16, device=device)
    w2 = torch.empty((slots_n, *raw.w2[0].shape[1:]), dtype=torch.bfloat16, device=device)
    g = torch.Generator().manual_seed(0)
    results: dict = {
        "device": torch.cuda.get_device_name(device),
        "expert_bytes": raw.expert_nbytes,
        "packed_expert_bytes": packed.expert_nbytes,
        "runs": [],
    }
    print(
        f"expert {raw.expert_nbytes / 1e6:.2f} MB, packed {packed.expert_nbytes / 1e6:.2f} MB "
        f"({packed.expert_nbytes / raw.expert_nbytes:.3f}), escapes {packed.escape_count} values"
    )

    misses = torch.zeros(64, 2, dtype=torch.int32, device=device)
    count = torch.zeros(1, dtype=torch.int32, device=device)
    plan: dict = {}

    def choose(n: int, i: int) -> None:
        experts = torch.randperm(e, generator=g)[:n]
        slots = torch.randperm(slots_n, generator=g)[:n]
        plan.update(layer=i % 2, pairs=list(zip(experts.tolist(), slots.tolist())))
        misses[:n].copy_(torch.stack([experts, slots], 1).to(torch.int32))
        count.fill_(n)
        torch.cuda.synchronize()

    def ce() -> None:
        for ex, s in plan["pairs"]:
            w13[s].copy_(raw.w13[plan["layer"]][ex], non_blocking=True)
            w2[s].copy_(raw.w2[plan["layer"]][ex], non_blocking=True)

    def sm() -> None:
        copy_experts_triton(raw.w13[plan["layer"]], raw.w2[plan["layer"]], w13, w2, misses, count)

    def unpack(programs: int, block: int):
        return lambda: packed.copy_listed(plan["layer"], w13, w2, misses, count, programs=programs, block=block)

    variants = [("copy engine", ce, raw.expert_nbytes), ("SM copy", sm, raw.expert_nbytes)]
    variants += [
        (f"SM unpack P={pr} B={bl}", unpack(pr, bl), packed.expert_nbytes)
        for pr in (32, 48, 64, 96)
        for bl in (1024, 2048, 4096)
    ]
    print(f"{'variant':<26}" + "".join(f"{f'{n} experts: wire, bf16':>34}" for n in (1, 6, 40)))
    for name, fn, wire in variants:
        row = {"variant": name}
        cells = []
        for n in (1, 6, 40):
            t = timed(fn, args.reps, setup=lambda i, n=n: choose(n, i))
            med = statistics.median(t)
            row[str(n)] = {
                "median_ms": med,
                "wire_GBps": n * wire / med / 1e6,
                "bf16_GBps": n * raw.expert_nbytes / med / 1e6,
            }
            cells.append(f"{med:7.3f} ms {row[str(n)]['wire_GBps']:5.1f} {row[str(n)]['bf16_GBps']:6.1f} GB/s")
        results["runs"].append(row)
        print(f"{name:<26}" + "".join(f"{c:>34}" for c in cells), flush=True)

    # the unpacking copy in a CUDA graph, replayed for new device-held lists: bit for bit
    ok = True
    try:
        stream = torch.cuda.Stream(device)
        choose(6, 0)
        packed.copy_listed(0, w13, w2, misses, count)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            packed.copy_listed(0, w13, w2, misses, count)
        for i, n in enumerate((6, 1, 40, 0, 17)):
            w13.fill_(0)
            w2.fill_(0)
            choose(n, 2 * i)  # even: layer 0, the graph's layer
            graph.replay()
            torch.cuda.synchronize()
            for ex, s in plan["pairs"]:
                ok &= torch.equal(w13[s].cpu().view(torch.int16), raw.w13[0][ex].view(torch.int16))
                ok &= torch.equal(w2[s].cpu().view(torch.int16), raw.w2[0][ex].view(torch.int16))
            if n == 0:
                ok &= bool((w13 == 0).all())
        results["graph_replay_6_experts_ms"] = statistics.median(
            timed(graph.replay, args.reps, setup=lambda i: choose(6, 2 * i))
        )
    except Exception as exc:  # noqa: BLE001 - reported, the rest still ran
        ok = f"{type(exc).__name__}: {exc}"
    results["graph_unpack_correct"] = ok
    print(
        f"unpacking copy in a CUDA graph, 5 new lists, bit for bit: {ok}; "
        f"6 experts {results.get('graph_replay_6_experts_ms', float('nan')):.3f} ms"
    )
    results["packing"] = packing_cost(raw, device, args.reps)
    print(f"packing: {results['packing']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def packing_cost(raw: HostBanks, device: torch.device, reps: int) -> dict:
    """One group of PACK_TEMP_BYTES' size packed on the device, as `fill_dummy` and loading do."""
    values = raw.w13[0][0].numel() + raw.w2[0][0].numel()
    n = min(raw.num_experts, max(1, PACK_TEMP_BYTES // (PACK_BYTES_PER_VALUE * values)))
    w13, w2 = raw.w13[0][:n].to(device), raw.w2[0][:n].to(device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    pack_experts(w13, w2)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - before
    med = statistics.median(timed(lambda: pack_experts(w13, w2), reps))
    zeros = sum(int((t == 0).sum()) for t in (raw.w13[0], raw.w2[0]))
    return {
        "experts": n,
        "median_ms": med,
        "bf16_GBps": n * values * 2 / med / 1e6,
        "peak_temp_bytes_per_value": peak / (n * values),
        "pack_bytes_per_value_assumed": PACK_BYTES_PER_VALUE,
        "dummy_zero_fraction": zeros / (raw.num_experts * values),
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    sys.exit(main())
