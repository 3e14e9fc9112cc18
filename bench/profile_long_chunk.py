"""Where one chunk of a long prompt's prefill spends its time, deep into the context (issue 24: the
261,988-token prompt's TTFT runs near the sum of its expert copies and its compute, although the two
overlap when measured alone, bench/ring_overlap.py).

Boots the worker as `ferry serve` would (boot + executor, no processes), prefills one request's random
prompt chunk by chunk (the plan's chunk), and at each context of `--at` profiles the next chunk with
torch.profiler. Per profiled chunk, from the device trace (µs on the GPU's clock):

* each stream's busy time (the union of its kernels and copies) and its kernels by family (the ring's
  unpacking copies, host->device copies, FlashAttention, the paged attention kernel, Gated DeltaNet,
  the experts' GEMM kernels, cuBLAS GEMMs, the rest) and the kernels taking the most time;
* the copies' overlap: the share of the expert copies' busy time (the unpacking kernel on packed banks,
  the copy engine's H2D on plain ones) during which another stream computed;
* the compute streams' idle time inside the chunk and its largest gaps, with what the copies did then;
* which kernels the compute waited for at the end of its gaps, and what computed while the copies stood still;
* the chunk's wall time, the host's enqueue span, and the expert cache's counters over the chunk.

Each profiled chunk's device events are kept (`device_events_at_<context>.json.gz`, a few hundred kB), so
the summary can be redone, or another question asked, without the GPU: `--summarize FILE`.

    python3 bench/profile_long_chunk.py --model DIR --load-format dummy --gpu-memory 24GiB \\
        --num-tokens 262144 --max-running-requests 8 --at 32768,196608 [--out FILE] [--trace-dir DIR]
    python3 bench/profile_long_chunk.py --summarize DIR/device_events_at_131072.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_prefill import HOST_LAUNCHES, _union  # noqa: E402
from bench.serve_decode import Streams, _cache_counters, _delta  # noqa: E402
from ferry.services.worker.boot import boot_worker  # noqa: E402
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args  # noqa: E402

# a kernel's family, by the first of these its name contains (lower case); the order matters
FAMILIES = (
    ("unpack_copies", ("unpack_experts", "_unpack")),
    ("expert_copy_kernel", ("expert_copy", "_copy_experts")),
    # with an fp8 KV pool, FlashAttention's K/V gather dequantizes (kernels/kv_gather_triton.py): part of its cost
    ("flash_attention", ("flash", "fmha", "sdpa", "_gather_dequantize")),
    # before the attention's: the Gated DeltaNet's conv kernels are `_conv_prefill_kernel` and the like
    (
        "gated_deltanet",
        ("chunk_", "gated_delta", "fused_recurrent", "causal_conv", "_conv_", "l2norm", "solve_tril", "wy_"),
    ),
    ("paged_attention", ("paged", "_attn", "_prefill_kernel", "_decode_split_kernel", "_decode_combine_kernel")),
    ("expert_gemm", ("grouped", "expert_gemm", "_moe", "_gate_up_kernel", "_down_kernel")),
    ("cublas_gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "gemv")),
    ("norm_rope_act", ("norm", "rotary", "silu", "rope", "combine")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_flags(parser)
    parser.add_argument(
        "--at", default="32768,196608", help="contexts (tokens already prefilled) whose next chunk is profiled"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="stop here (default: the last --at plus one chunk)"
    )
    parser.add_argument(
        "--ring-chunks",
        default="",
        help="at each --at, profile one chunk per staging-ring chunk size (experts a copy and a "
        "computation; 0: the worker's own), in successive chunks, e.g. 0,48",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace-dir", default=None, help="keep each profiled chunk's chrome trace here")
    parser.add_argument(
        "--events-dir",
        default=None,
        help="write each profiled chunk's device events here (device_events_at_<context>.json.gz; "
        "default: --trace-dir)",
    )
    parser.add_argument(
        "--summarize",
        default=None,
        metavar="EVENTS",
        help="only summarise a saved device_events_at_*.json.gz (no GPU, no model)",
    )
    if "--summarize" in sys.argv:  # offline: no worker flags needed
        path = sys.argv[sys.argv.index("--summarize") + 1]
        print(json.dumps(summarize_events(*load_events(Path(path))), indent=1))
        return
    args = parser.parse_args()
    at = sorted(int(a) for a in args.at.split(",") if a)
    t_boot = time.perf_counter()
    executor, plan = boot_worker(boot_config_from_args(args))
    boot_s = time.perf_counter() - t_boot
    chunk = plan.max_prefill_tokens
    prompt_len = args.prompt_len or (at[-1] + chunk)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, executor.spec.vocab_size, prompt_len).tolist()
    streams = Streams(executor, 1, prompt_len + 8, first_req_id=1)
    new = [_new_request(streams, prompt)]
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="ferry-long-chunk-"))
    trace_dir.mkdir(parents=True, exist_ok=True)
    ring = getattr(executor.store, "ring", None)
    ring_default = (ring.base_chunk, ring.long_chunk) if ring is not None else None
    ring_chunks = [int(c) for c in args.ring_chunks.split(",") if c] or [0]
    if ring is None and ring_chunks != [0]:
        raise SystemExit("--ring-chunks: this worker's store has no staging ring (nothing streams)")
    for c in ring_chunks:
        if ring is not None and not 0 <= c <= ring.size:
            raise SystemExit(f"--ring-chunks: {c} experts do not fit the ring's {ring.size} staging slots")
    chunks, profiles, done, todo = [], [], 0, []
    while done < prompt_len:
        part = prompt[done : done + chunk]
        last = done + len(part) >= prompt_len
        if at and done >= at[0]:
            at.pop(0)
            todo = list(ring_chunks)  # this chunk and the next ones, one a ring chunk size
        profile_here = bool(todo)
        before = _cache_counters(executor)
        _sync()
        if profile_here:
            ring_chunk = todo.pop(0)
            if ring is not None:
                # the ring re-cuts its bays as the step begins (a chunk deep in a long prompt lends: long_chunk)
                ring.use_chunks(*((ring_chunk, ring_chunk) if ring_chunk else ring_default))
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                t0 = time.perf_counter()
                streams.step([part], sample=last, new=new)
                _sync()
                wall = time.perf_counter() - t0
            path = trace_dir / f"chunk_at_{done}.json"  # one name a context: --ring-chunks profile successive ones
            prof.export_chrome_trace(str(path))
            device, launches = device_events(json.loads(path.read_text()))
            save_events(Path(args.events_dir or trace_dir) / f"device_events_at_{done}.json.gz", device, launches)
            summary = summarize_events(device, launches)
            if ring is not None:
                ring.use_chunks(*ring_default)
            profiles.append(
                {
                    "context": done,
                    "tokens": len(part),
                    "wall_ms": wall * 1e3,
                    "ring_chunk": ring.chunk if ring is not None else None,  # what the step cut at
                    "expert_cache": _delta(_cache_counters(executor), before),
                    **summary,
                }
            )
            print(
                json.dumps({k: v for k, v in profiles[-1].items() if k not in ("largest_compute_gaps", "streams")}),
                flush=True,
            )
        else:
            t0 = time.perf_counter()
            streams.step([part], sample=last, new=new)
            _sync()
            wall = time.perf_counter() - t0
        chunks.append(
            {
                "context": done,
                "wall_s": round(wall, 4),
                "copied": _delta(_cache_counters(executor), before)["bytes_copied"],
            }
        )
        new, done = [], done + len(part)
    streams.finish()
    result = {
        "boot_s": boot_s,
        "prompt_len": prompt_len,
        "chunk": chunk,
        "slots": plan.experts.slots,
        "experts": plan.experts.total,
        "prefill_s": sum(c["wall_s"] for c in chunks),
        "chunks": chunks,
        "profiles": profiles,
    }
    text = json.dumps(result, indent=1)
    print(
        f"prefill of {prompt_len} tokens in {len(chunks)} chunks: {result['prefill_s']:.2f} s (synchronised per chunk)"
    )
    if args.out:
        Path(args.out).write_text(text + "\n")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _new_request(streams: Streams, prompt: list[int]):
    from bench.serve_decode import GREEDY
    from ferry.shared.step import NewRequest

    return NewRequest(req_id=streams.req_ids[0], prompt_token_ids=np.array(prompt, dtype=np.int32), sampling=GREEDY)


def device_events(trace: dict) -> tuple[list[tuple], list[tuple[float, float]]]:
    """(device events as (start µs, end µs, stream, family, name), host launch spans) of a chrome trace
    of one step (kineto's: device events carry args.stream)."""
    device, launches = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = e["name"]
            fam = family(name) if cat == "kernel" else ("h2d_copies" if "HtoD" in name else cat)
            device.append(
                (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("args", {}).get("stream"), fam, name)
            )
        elif e.get("name") in HOST_LAUNCHES:
            launches.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    device.sort()
    return device, launches


def save_events(path: Path, device: list[tuple], launches: list[tuple[float, float]]) -> None:
    """The device events (a few hundred kB gzipped where the chrome trace is tens of MB), for
    `--summarize` on a machine without the GPU."""
    with gzip.open(path, "wt") as f:
        json.dump({"device": device, "launches": launches}, f)


def load_events(path: Path) -> tuple[list[tuple], list[tuple[float, float]]]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return [tuple(e) for e in data["device"]], [tuple(s) for s in data["launches"]]


COPY_FAMILIES = ("unpack_copies", "expert_copy_kernel", "h2d_copies")


def summarize_trace(trace: dict, largest: int = 8, top: int = 16) -> dict:
    return summarize_events(*device_events(trace), largest=largest, top=top)


def summarize_events(device: list[tuple], launches: list[tuple[float, float]], largest: int = 8, top: int = 16) -> dict:
    """Per-stream busy time, kernel families, the copies' overlap with compute, the compute's gaps (and
    which family waited at their end), and the copies' own idle time (and what computed meanwhile)."""
    if not device:
        return {"device_events": 0}
    copy_events = [(a, b) for a, b, _, fam, _ in device if fam in COPY_FAMILIES]
    compute_events = [(a, b, fam) for a, b, _, fam, _ in device if fam not in COPY_FAMILIES and fam != "gpu_memset"]
    copies = _union(copy_events)
    compute = _union([(a, b) for a, b, _ in compute_events])
    start, end = min(a for a, *_ in device), max(b for _, b, *_ in device)
    streams: dict[str, dict] = {}
    for a, b, stream, fam, _ in device:
        st = streams.setdefault(str(stream), {"events": 0, "spans": [], "families_ms": {}})
        st["events"] += 1
        st["spans"].append((a, b))
        st["families_ms"][fam] = st["families_ms"].get(fam, 0.0) + (b - a) / 1e3
    for st in streams.values():
        st["busy_ms"] = round(_length(_union(st.pop("spans"))) / 1e3, 3)
        st["families_ms"] = {k: round(v, 3) for k, v in sorted(st["families_ms"].items(), key=lambda kv: -kv[1])}
    families: dict[str, float] = {}
    kernels: dict[str, list] = {}  # name -> [ms, count]
    for a, b, _, fam, name in device:
        families[fam] = families.get(fam, 0.0) + (b - a) / 1e3
        k = kernels.setdefault(name[:100], [0.0, 0])
        k[0] += (b - a) / 1e3
        k[1] += 1
    copies_busy, compute_busy = _length(copies), _length(compute)
    both = _length(_intersect(copies, compute))
    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in zip(compute, compute[1:]) if b[0] > a[1]]
    # a compute gap ends when some kernel can start: the family of that kernel is what waited (on the copies,
    # or on the host)
    starts = sorted((a, fam) for a, _, fam in compute_events)
    waited: dict[str, list] = {}
    j = 0
    for g, _, until in sorted(gaps, key=lambda x: x[2]):
        while j < len(starts) and starts[j][0] < until:
            j += 1
        fam = starts[j][1] if j < len(starts) else "none"
        w = waited.setdefault(fam, [0.0, 0])
        w[0] += g / 1e3
        w[1] += 1
    gaps.sort(reverse=True)
    # the copies' own idle time between their first and last copy, and what computed meanwhile (a copy
    # stream idle during a long kernel: the ring was full, or the kernel held the SMs the unpacking needs)
    copy_idle = [(a[1], b[0]) for a, b in zip(copies, copies[1:]) if b[0] > a[1]]
    idle_during: dict[str, float] = {}
    for fam in {f for *_, f in compute_events}:
        spans = _union([(a, b) for a, b, f in compute_events if f == fam])
        idle_during[fam] = _length(_intersect(copy_idle, spans)) / 1e3
    return {
        "device_span_ms": round((end - start) / 1e3, 3),
        "compute_busy_ms": round(compute_busy / 1e3, 3),
        "copies_busy_ms": round(copies_busy / 1e3, 3),
        "copies_hidden_by_compute_ms": round(both / 1e3, 3),
        # the share of the copies' time during which some kernel computed: 1.0 is full overlap
        "copy_overlap": round(both / copies_busy, 3) if copies_busy else None,
        "compute_idle_ms": round((end - start - compute_busy) / 1e3, 3),
        # compute idle by the family of the kernel that ran when the gap closed: [ms, gaps]
        "compute_gaps_by_waiting_family": {
            k: [round(v[0], 3), v[1]] for k, v in sorted(waited.items(), key=lambda kv: -kv[1][0])
        },
        "copies_idle_ms": round(_length(copy_idle) / 1e3, 3),
        "copies_idle_during_family_ms": {
            k: round(v, 3) for k, v in sorted(idle_during.items(), key=lambda kv: -kv[1]) if v
        },
        "before_first_copy_ms": round((copies[0][0] - start) / 1e3, 3) if copies else None,
        "after_last_copy_ms": round((end - copies[-1][1]) / 1e3, 3) if copies else None,
        "families_ms": {k: round(v, 3) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        "streams": streams,
        # the kernels (and copies) taking the most device time: [name, ms, count]
        "top_kernels": [[n, round(ms, 3), c] for n, (ms, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]],
        # (ms long, ms after the chunk's first device event, the copies' busy ms inside the gap)
        "largest_compute_gaps": [
            (round(g / 1e3, 3), round((t - start) / 1e3, 3), round(_length(_intersect(copies, [(t, t + g)])) / 1e3, 3))
            for g, t, _ in gaps[:largest]
        ],
        "host_enqueue_span_ms": round((max(b for _, b in launches) - min(a for a, _ in launches)) / 1e3, 3)
        if launches
        else None,
        "host_launches": len(launches),
        # time the host spent inside those calls: near the enqueue span, the launch queue was full and the host
        # waited for the device (ahead of it); small, the host's own work between launches paced the chunk
        "host_in_launch_calls_ms": round(_length(launches) / 1e3, 3) if launches else None,
        "host_longest_launch_call_ms": round(max(b - a for a, b in launches) / 1e3, 3) if launches else None,
    }


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intersection of two sorted, disjoint span lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if lo < hi:
            out.append((lo, hi))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


if __name__ == "__main__":
    main()
