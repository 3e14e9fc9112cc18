"""How a decode step's time moves with the host's share of its layers (issue 25): the split swept by hand.

Each decode layer hands the host the misses that the balance of measured prices gives it
(kernels/expert_host_handoff.py: the link's copies against the hand-off plus the host's experts), and
auto's guard (services/worker/offload/host_compute/share_guard.py) scales the host's price between 0.5 and 1.25 by
what the served steps measure. On an H100 the guard found 0.8, 1 and 1.25 within 2 % of each other on
the hybrid cut, while a profile of its step (bench/NOTES.md, 2026-12-05) showed the host's share as the
layer's critical path: ~440 µs from the hand-off kernel to the fold for three experts, against the
~285 µs boot's prices add up to (3 x 83.5 µs and a 33.7 µs hand-off). With a handful of misses a layer,
the share is an integer that a price scale of 1.25 rarely moves; the question is what one expert fewer
or more on the host does to the step.

This boots the worker as `ferry serve` would (the worker's flags; `--expert-backend hybrid` or auto),
turns the refinement of the host's price off, and decodes one stream of random tokens under each
setting of `--settings` in turn, `--rounds` times round robin (so the context's growth and the host's
drift fall on every setting alike). A setting is the host's one-token price scaled (`1.5`: the host
takes fewer), optionally with microseconds added to the hand-off's price (`1.0+150`: the layer's own
compute and the hand-off's latency under a full link, which the boot calibration does not see), or
`off` (the hand-off runs and gives the host nothing, as auto's guard does). Per setting: the median and
mean milliseconds a step (each step is timed whole, the sampled token back on the host, so the host's
own ~1 ms a step is in every setting alike), the experts a token the host computed, and the experts a
token crossed PCIe.

    python3 bench/host_split_sweep.py --model DIR --load-format dummy --moe-cache-size 640 --gpu-memory 12GiB \\
        --expert-backend hybrid --settings off,1.0,0.8,1.25,1.5,2.0,1.0+100,1.0+200 --out sweep.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_decode import Streams  # noqa: E402

SETTING = re.compile(r"^(off|\d+(?:\.\d+)?)(?:\+(\d+(?:\.\d+)?))?$")
SETTLE_STEPS = 3  # untimed steps after each change of setting: the cache's contents follow the split
PROMPT_TOKENS = 64


def stream_tokens(warm_steps: int, rounds: int, settings: int, steps: int) -> int:
    """The context one stream reaches over the whole sweep (its KV pages are reserved up front): the
    prompt, the warm steps, and every setting's settle and timed steps in every round, and a margin."""
    return PROMPT_TOKENS + warm_steps + rounds * settings * (SETTLE_STEPS + steps) + 8


def parse_settings(text: str) -> list[tuple[str, float | None, float]]:
    """`off,1.0,1.5+100` -> [(name, scale or None for off, µs added to the hand-off)]; ValueError naming
    the flag for anything else."""
    out = []
    for item in text.split(","):
        m = SETTING.match(item.strip())
        if not m or (m.group(1) == "off" and m.group(2)):
            raise ValueError(f"--settings {text}: {item!r} is not `off`, a scale (1.5) or a scale plus µs (1.0+150)")
        scale = None if m.group(1) == "off" else float(m.group(1))
        if scale is not None and scale <= 0:
            raise ValueError(f"--settings {text}: {item!r}: a scale must be above 0")
        out.append((item.strip(), scale, float(m.group(2) or 0.0)))
    if len({name for name, _, _ in out}) != len(out):
        raise ValueError(f"--settings {text}: a setting is named twice")
    return out


def prices_for(base_ns: tuple[int, int, int, int], scale: float | None, extra_us: float, off_ns: int):
    """The hand-off's four prices (pcie, host at one token, host a token more, hand-off) under a setting."""
    pcie, at_1, per_token, handoff = base_ns
    host = off_ns if scale is None else max(1, round(at_1 * scale))
    return pcie, host, per_token, handoff + round(extra_us * 1e3)


def summarize(times_s: list[float], host_experts: int, crossed: int, copied_bytes: int, tokens: int) -> dict:
    return {
        "steps": len(times_s),
        "median_ms": round(1e3 * statistics.median(times_s), 3),
        "mean_ms": round(1e3 * statistics.fmean(times_s), 3),
        "host_experts_per_token": round(host_experts / tokens, 3),
        "crossed_experts_per_token": round(crossed / tokens, 3),
        "copied_mb_per_token": round(copied_bytes / tokens / 1e6, 2),
    }


def main() -> int:
    from ferry.services.worker.boot import boot_worker
    from ferry.services.worker.flags import add_worker_flags, boot_config_from_args
    from ferry.services.worker.offload.host_compute.decode_share import OFF_PRICE_NS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_flags(parser)
    parser.add_argument("--settings", default="off,1.0,0.8,1.25,1.5,2.0,1.0+100,1.0+200")
    parser.add_argument("--steps", type=int, default=150, help="decode steps a setting a round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warm-steps", type=int, default=100, help="untimed steps first (the cache fills)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    try:
        settings = parse_settings(args.settings)
    except ValueError as exc:
        parser.error(str(exc))
    executor, plan = boot_worker(boot_config_from_args(args))
    store = executor.store
    share = getattr(store, "host_decode", None)
    if share is None:
        raise SystemExit(
            "host_split_sweep: the worker booted without a decode share (the boot log says why; "
            "pass --expert-backend hybrid)"
        )
    share.refines, share.guard = False, None  # the prices stay what each setting says
    base = tuple(share.costs_ns)
    rng = np.random.default_rng(0)
    vocab = executor.spec.vocab_size
    streams = Streams(
        executor, 1, stream_tokens(args.warm_steps, args.rounds, len(settings), args.steps), first_req_id=1
    )
    streams.prefill([rng.integers(0, vocab, PROMPT_TOKENS).tolist()])

    def step() -> float:
        t0 = time.perf_counter()
        streams.step([[int(rng.integers(0, vocab))]], sample=True)
        return time.perf_counter() - t0

    for _ in range(args.warm_steps):
        step()
    times = {name: [] for name, _, _ in settings}
    host = dict.fromkeys(times, 0)
    crossed = dict.fromkeys(times, 0)
    copied = dict.fromkeys(times, 0)
    for _ in range(args.rounds):
        for name, scale, extra_us in settings:
            share.costs_ns = prices_for(base, scale, extra_us, OFF_PRICE_NS)
            for _ in range(SETTLE_STEPS):
                step()
            before, cache0 = share.report()["experts"], executor.expert_cache_report()
            times[name].extend(step() for _ in range(args.steps))
            after, cache1 = share.report()["experts"], executor.expert_cache_report()
            host[name] += after - before
            # the lookups' misses count those handed to the host too (offload/stores/device_driven.py's report):
            # the rest crossed
            looked_up = (cache1["misses"] - cache0["misses"]) + (cache1["prefetched"] - cache0["prefetched"])
            crossed[name] += looked_up - (after - before)
            copied[name] += cache1["bytes_copied"] - cache0["bytes_copied"]
    share.costs_ns = base
    tokens = args.rounds * args.steps
    rows = {
        name: {
            "scale": scale,
            "handoff_extra_us": extra_us,
            **summarize(times[name], host[name], crossed[name], copied[name], tokens),
        }
        for name, scale, extra_us in settings
    }
    off = rows.get("off")
    for name, row in rows.items():
        row["vs_off"] = round(off["median_ms"] / row["median_ms"], 3) if off else None
        print(
            f"{name:>10}: median {row['median_ms']:.3f} ms a step (mean {row['mean_ms']:.3f}), host "
            f"{row['host_experts_per_token']:.2f} experts a token, PCIe {row['crossed_experts_per_token']:.2f}"
            + (f", {row['vs_off']:.3f}x off" if off else ""),
            flush=True,
        )
    result = {
        "model": str(args.model),
        "prices_ns": list(base),
        "handoff": share.handoff,
        "slots": plan.experts.slots,
        "experts": plan.experts.total,
        "steps": args.steps,
        "rounds": args.rounds,
        "settings": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    streams.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
