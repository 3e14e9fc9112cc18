"""Where issue 23's warm step spends its time: 8 requests whose 4k-token system prompt is already computed
each add their own ~156 tokens in one prefill step (what the prefix cache's warm round runs: bench/NOTES.md,
"Decode's MoE layer in two launches": 1,250 tokens, 0.122 s, ~2x its pass over the uncached experts), and,
for comparison, one chunk of the round without the cache (the 8 prompts' tokens in chunks of the plan's).

Boots the worker as `ferry serve` would (boot + executor, no processes), prefills the 8 streams' shared
prefix (each its own KV pages and linear state, as the snapshot restore gives them), then profiles with
torch.profiler the step of the 8 suffixes, `--repeats` times (each on fresh streams: a step's copies
depend on what the cache holds, and decode is not run in between), and one baseline chunk. Per profiled
step it prints the summary of bench/profile_long_chunk.py (each stream's busy time and kernel families,
the copies' overlap with compute, the compute's idle gaps, the host's launch span), the bytes the step
copied and their time at `--link-gbps` (the pass a step that routes every expert cannot go below). The
device events are kept (`device_events_<name>.json.gz`) for `profile_long_chunk.py --summarize`.
`--host-profile N` then runs N more warm steps without torch.profiler, under cProfile: their wall time and
where the host's Python spends it (the warm step's launches span the whole step on the H200: the device waits
on the host), the functions by own time and, of the project's own, by cumulative time.

    python3 bench/profile_shared_prefix_step.py --model DIR --load-format dummy --moe-cache-size 640 \\
        --gpu-memory 12GiB --max-running-requests 8 --out FILE --events-dir DIR
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_long_chunk import device_events, save_events, summarize_events  # noqa: E402
from bench.serve_decode import GREEDY, Streams, _cache_counters, _delta  # noqa: E402
from ferry.services.worker.boot import boot_worker  # noqa: E402
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args  # noqa: E402
from ferry.shared.step import NewRequest  # noqa: E402

ROWS = 8


def profiled(
    streams: Streams,
    parts: list[list[int]],
    new,
    sample: bool,
    name: str,
    trace_dir: Path,
    events_dir: Path,
    executor,
    link_gbps: float,
) -> dict:
    """One step of `parts` (a list a stream) under torch.profiler: its summary, wall time and copies."""
    before = _cache_counters(executor)
    _sync()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        t0 = time.perf_counter()
        streams.step(parts, sample=sample, new=new)
        _sync()
        wall = time.perf_counter() - t0
    path = trace_dir / f"{name}.json"
    prof.export_chrome_trace(str(path))
    device, launches = device_events(json.loads(path.read_text()))
    save_events(events_dir / f"device_events_{name}.json.gz", device, launches)
    copied = _delta(_cache_counters(executor), before)
    return {
        "step": name,
        "rows": len(parts),
        "tokens": sum(len(p) for p in parts),
        "wall_ms": wall * 1e3,
        "copied_bytes": copied["bytes_copied"],
        "pass_ms_at_link": copied["bytes_copied"] / link_gbps / 1e6,
        **summarize_events(device, launches),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_flags(parser)
    parser.add_argument("--prefix", type=int, default=3952, help="the shared system prompt's tokens")
    parser.add_argument("--suffix", type=int, default=156, help="each request's own tokens after it")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--ring-chunks",
        default="0",
        help="profile the warm step once per staging-ring chunk size (experts a copy and a "
        "computation; 0: the worker's own), e.g. 0,24,48: fewer, larger chunks pay the host's "
        "launches fewer times, with fewer bays to overlap in",
    )
    parser.add_argument("--link-gbps", type=float, default=55.0, help="host-to-device GB/s for the pass's bound")
    parser.add_argument(
        "--host-profile",
        type=int,
        default=0,
        help="warm steps run after the device profiles under cProfile, without torch.profiler",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--events-dir", default=None)
    args = parser.parse_args()
    executor, plan = boot_worker(boot_config_from_args(args))
    rng = np.random.default_rng(0)
    vocab = executor.spec.vocab_size
    prefix = rng.integers(0, vocab, args.prefix).tolist()
    trace_dir = Path(tempfile.mkdtemp(prefix="ferry-shared-prefix-"))
    events_dir = Path(args.events_dir or trace_dir)
    events_dir.mkdir(parents=True, exist_ok=True)
    length = args.prefix + args.suffix + 8
    ring = getattr(executor.store, "ring", None)
    default = (ring.base_chunk, ring.long_chunk) if ring is not None else None
    ring_chunks = [int(c) for c in args.ring_chunks.split(",") if c] or [0]
    if ring is None and ring_chunks != [0]:
        raise SystemExit("--ring-chunks: this worker's store has no staging ring (nothing streams)")
    profiles, first_req = [], 1
    for ring_chunk in ring_chunks:
        if ring is not None:
            ring.use_chunks(*((ring_chunk, ring_chunk) if ring_chunk else default))
        for r in range(args.repeats):
            streams, suffixes = warm_round(executor, prefix, length, args.suffix, rng, first_req)
            first_req += ROWS
            name = f"warm_step_{r}" if not ring_chunk else f"warm_step_ring{ring_chunk}_{r}"
            profiles.append(
                profiled(streams, suffixes, None, True, name, trace_dir, events_dir, executor, args.link_gbps)
                | {"ring_chunk": ring.chunk if ring is not None else None}
            )
            streams.finish()
            print(
                json.dumps({k: v for k, v in profiles[-1].items() if k not in ("largest_compute_gaps", "streams")}),
                flush=True,
            )
    if ring is not None:
        ring.use_chunks(*default)
    host = None
    if args.host_profile:
        host = host_profiled(executor, prefix, length, args.suffix, args.host_profile, rng, first_req)
        first_req += ROWS * args.host_profile
        print(json.dumps({"host_profile_wall_ms": host["wall_ms"]}), flush=True)
        for row in host["by_own_time"][:25]:
            print(
                f"  {row['own_ms']:8.2f} ms own {row['cum_ms']:8.2f} ms cum {row['calls']:7d} calls  {row['function']}"
            )
    # the round without the cache: the 8 whole prompts, chunked as the scheduler cuts them (its first chunk)
    streams = Streams(executor, ROWS, length, first_req_id=first_req)
    per_row = max(1, plan.max_prefill_tokens // ROWS)
    prompts = [prefix + rng.integers(0, vocab, args.suffix).tolist() for _ in range(ROWS)]
    new = [
        NewRequest(req_id=q, prompt_token_ids=np.array(p, dtype=np.int32), sampling=GREEDY)
        for q, p in zip(streams.req_ids, prompts)
    ]
    profiles.append(
        profiled(
            streams,
            [p[:per_row] for p in prompts],
            new,
            False,
            "baseline_chunk",
            trace_dir,
            events_dir,
            executor,
            args.link_gbps,
        )
    )
    streams.finish()
    print(
        json.dumps({k: v for k, v in profiles[-1].items() if k not in ("largest_compute_gaps", "streams")}), flush=True
    )
    result = {
        "slots": plan.experts.slots,
        "experts": plan.experts.total,
        "chunk": plan.max_prefill_tokens,
        "prefix": args.prefix,
        "suffix": args.suffix,
        "profiles": profiles,
        "host_profile": host,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def warm_round(executor, prefix: list[int], length: int, suffix: int, rng, first_req: int) -> tuple[Streams, list]:
    """ROWS fresh streams holding the prefix's KV and state (as a snapshot's restore gives them), and each
    one's own `suffix` random tokens: the warm round's step, ready to run."""
    streams = Streams(executor, ROWS, length, first_req_id=first_req)
    streams.prefill([prefix] * ROWS)
    return streams, [rng.integers(0, executor.spec.vocab_size, suffix).tolist() for _ in range(ROWS)]


def host_profiled(executor, prefix: list[int], length: int, suffix: int, steps: int, rng, first_req: int) -> dict:
    """`steps` warm steps (each on fresh streams given the prefix) under cProfile: wall times, and the
    functions by own time (the 40 first) and the project's by cumulative time (the 40 first), summed over
    the steps."""
    profile, walls = cProfile.Profile(), []
    for r in range(steps):
        streams, suffixes = warm_round(executor, prefix, length, suffix, rng, first_req + r * ROWS)
        _sync()
        t0 = time.perf_counter()
        profile.enable()
        streams.step(suffixes, sample=True, new=None)
        _sync()
        profile.disable()
        walls.append(round((time.perf_counter() - t0) * 1e3, 3))
        streams.finish()
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in pstats.Stats(profile).stats.items():
        where = path if path.startswith("<") or path == "~" else f"{_short(path)}:{line}"
        rows.append(
            {
                "function": f"{where} {name}",
                "calls": calls,
                "own_ms": round(own * 1e3, 3),
                "cum_ms": round(cum * 1e3, 3),
                "ours": _ours(path),
            }
        )
    by_own = sorted(rows, key=lambda r: -r["own_ms"])[:40]
    by_cum = sorted((r for r in rows if r["ours"]), key=lambda r: -r["cum_ms"])[:40]
    return {"steps": steps, "wall_ms": walls, "by_own_time": by_own, "ours_by_cumulative_time": by_cum}


_ROOT = str(Path(__file__).resolve().parents[1]) + "/"


def _ours(path: str) -> bool:
    return path.startswith(_ROOT) and "/site-packages/" not in path and "/.venv/" not in path


def _short(path: str) -> str:
    """A path relative to the checkout for the project's files, else from its package directory on."""
    if _ours(path):
        return path[len(_ROOT) :]
    parts = Path(path).parts
    return "/".join(parts[parts.index("site-packages") + 1 :]) if "site-packages" in parts else path


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
