"""Where the served decode step's host time goes: py-spy samples the api, the scheduler and the worker
of a running `ferry serve` while N streams decode, and this script folds the samples into one JSON.

The decode step's device time is measured by bench/profile_decode.py; when the served rate is well
below it, one of the three processes' loops paces the server. py-spy (a sampling profiler outside
the process: it costs the target nothing it would notice) tells which: per process and thread the
fraction of wall time it was on a CPU (`busy`), and the functions it was in (`self`: the innermost
frame; `inclusive`: anywhere on the stack), as fractions of the samples.

The server runs with FERRY_STEP_TRACE (shared/step_trace.py), so each run also has the step's timeline
(`timeline`, medians over the steps of the sampled window): the device's time per step and its idle
time before each, the worker's launch, the time from the scheduler's send to the worker's read (the
worker reads once its loop is free), from the worker's answer to the scheduler's read, and the
scheduler's turn (from a step's answer landing to the step two after it leaving, the one it
schedules ahead). With a decode share on the host, `host_nodes` is its host nodes over the window: their
calls, mean wall time, and the calls at most each bound (ferry_worker_host_node_call_seconds), its tail.

    python3 bench/profile_serve.py --workload hybrid8_resident --streams 1,8 --seconds 6 --out out.json

py-spy comes from its wheel (`pip install py-spy`); `--py-spy PATH` names the binary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode_suite import WORKLOADS, commit, host_share_series, workload_model  # noqa: E402
from bench.serve_process import children_of, start_serve  # noqa: E402

ROLES = ("api", "scheduler", "worker")


def role_pids(serve_pid: int) -> dict[str, int]:
    """The api, scheduler and worker processes `ferry serve` started (by their command lines)."""
    out = {}
    for pid in children_of(serve_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        words = [a.decode(errors="replace") for a in argv]
        for role in ROLES:
            if role in words and role not in out:
                out[role] = pid
    return out


def fold(raw: Path, seconds: float, rate: int, top: int) -> dict:
    """py-spy's raw output (`frames... count` lines, the thread first with --threads) as busy fractions
    per thread and the top functions by self and inclusive samples."""
    threads: dict[str, dict] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():  # not a `frames count` line
            continue
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        n = int(count)
        t = threads.setdefault(
            thread, {"samples": 0, "self": collections.Counter(), "inclusive": collections.Counter()}
        )
        t["samples"] += n
        if frames:
            t["self"][frames[-1]] += n
        for f in set(frames):
            t["inclusive"][f] += n
    expected = seconds * rate
    out = {}
    for name, t in sorted(threads.items(), key=lambda kv: -kv[1]["samples"]):
        s = t["samples"]
        out[name] = {
            "busy": round(s / expected, 3),
            "samples": s,
            "self": [[f, round(c / s, 3)] for f, c in t["self"].most_common(top)],
            "inclusive": [[f, round(c / s, 3)] for f, c in t["inclusive"].most_common(top)],
        }
    return out


def median_of_present(values: list) -> float | None:
    present = [v for v in values if v is not None]  # device times are None off CUDA
    return statistics.median(present) if present else None


def timeline(scheduler: list[dict], worker: list[dict], t0: float, t1: float) -> dict:
    """Medians (ms) over the steps the worker answered within [t0, t1], from the trace lines; the steps'
    interval also as its mean, 90th percentile and longest (a served rate is the mean: a median of the
    intervals, as auto's guard measures them, hides a tail)."""
    sent = {e["step"]: e["sent"] for e in scheduler if "sent" in e}
    landed = {e["step"]: e["landed"] for e in scheduler if "landed" in e}
    steps = sorted((e for e in worker if t0 <= e["answered"] <= t1), key=lambda e: e["answered"])
    ms = 1e3
    ids = [e["step"] for e in steps]
    intervals = sorted((b["answered"] - a["answered"]) * ms for a, b in zip(steps, steps[1:]))
    return {
        "steps": len(steps),
        "rows": median_of_present([e["rows"] for e in steps]),
        "step_interval_ms": median_of_present(intervals),
        "step_interval_mean_ms": statistics.mean(intervals) if intervals else None,
        "step_interval_p90_ms": intervals[int(0.9 * (len(intervals) - 1))] if intervals else None,
        "step_interval_max_ms": intervals[-1] if intervals else None,
        "device_ms": median_of_present([e["device_ms"] for e in steps]),
        "device_idle_ms": median_of_present([e["idle_ms"] for e in steps]),
        "worker_launch_ms": median_of_present([(e["launched"] - e["recv"]) * ms for e in steps]),
        "worker_answer_ms": median_of_present([(e["answered"] - e["launched"]) * ms for e in steps]),
        "sent_to_worker_read_ms": median_of_present(
            [(e["recv"] - sent[e["step"]]) * ms for e in steps if e["step"] in sent]
        ),
        "answer_to_scheduler_ms": median_of_present(
            [(landed[e["step"]] - e["answered"]) * ms for e in steps if e["step"] in landed]
        ),
        "scheduler_turn_ms": median_of_present(
            [(sent[k + 2] - landed[k]) * ms for k in ids if k in landed and k + 2 in sent]
        ),
    }


def trace_lines(trace_dir: Path, role: str) -> list[dict]:
    out = []
    for path in trace_dir.glob(f"{role}-*.jsonl"):
        out.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return out


def load(base: str, streams: int, max_tokens: int, stop: threading.Event, counts: list) -> list[threading.Thread]:
    """`streams` threads, each streaming completions of `max_tokens` tokens back to back until `stop`."""
    from openai import OpenAI

    def run(i: int) -> None:
        client = OpenAI(base_url=base + "/v1", api_key="none", timeout=600)
        model = client.models.list().data[0].id
        while not stop.is_set():
            resp = client.completions.create(
                model=model,
                prompt=[10 + i, 17, 99, 3],
                max_tokens=max_tokens,
                stream=True,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            for chunk in resp:
                if chunk.choices and chunk.choices[0].text:
                    counts[i] += 1
                if stop.is_set():
                    break

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    return threads


def profile(
    served,
    py_spy: str,
    streams: int,
    max_tokens: int,
    seconds: float,
    rate: int,
    top: int,
    tmp: Path,
    trace_dir: Path,
    spy_flags: tuple[str, ...] = (),
    settle: float = 4.0,
) -> dict:
    pids = role_pids(served.proc.pid)
    stop, counts = threading.Event(), [0] * streams
    threads = load(served.base, streams, max_tokens, stop, counts)
    time.sleep(settle)  # the streams are decoding (the graphs of their batch size warm, auto's guard settled)
    hosts0 = host_share_series(served.worker_metrics)
    before, t0 = sum(counts), time.monotonic()
    spies = {}
    for role, pid in pids.items():
        raw = tmp / f"{role}_{streams}.txt"
        spies[role] = (
            raw,
            subprocess.Popen(
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(pid),
                    "--duration",
                    str(int(seconds)),
                    "--rate",
                    str(rate),
                    "--format",
                    "raw",
                    "--threads",
                    "--nonblocking",
                    *spy_flags,
                    "--output",
                    str(raw),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            ),
        )
    for role, (raw, proc) in spies.items():
        proc.wait(timeout=seconds + 60)
    t1 = time.monotonic()
    tokens, wall = sum(counts) - before, t1 - t0
    hosts1 = host_share_series(served.worker_metrics)
    time.sleep(1.0)  # still decoding: the processes write their trace lines at most 0.25 s after each
    stop.set()
    for t in threads:
        t.join(timeout=30)
    out = {
        "streams": streams,
        "tokens_per_s": round(tokens / wall, 1),
        "step_ms": round(1000 * wall * streams / max(tokens, 1), 3),
        "timeline": timeline(trace_lines(trace_dir, "scheduler"), trace_lines(trace_dir, "worker"), t0, t1),
    }
    if hosts0 and hosts1:  # the decode share's host nodes over the window: their calls by wall time
        out["host_nodes"] = host_nodes_window(hosts0, hosts1)
    for role, (raw, proc) in spies.items():
        err = proc.stderr.read().decode()[-400:] if proc.stderr else ""
        out[role] = fold(raw, seconds, rate, top) if raw.exists() else {"error": err}
    return out


def host_nodes_window(before: dict, after: dict) -> dict:
    """The decode share's host nodes between two of host_share_series' readings: calls, their mean wall
    time, and how many took at most each bucket's bound (cumulative, as the histogram exports them)."""
    calls = after["host_node_calls"] - before["host_node_calls"]
    busy = after["host_node_busy_s"] - before["host_node_busy_s"]
    le0, le1 = before.get("host_node_calls_le", {}), after.get("host_node_calls_le", {})
    return {
        "calls": calls,
        "mean_us": round(1e6 * busy / calls, 1) if calls else None,
        "calls_le": {le: n - le0.get(le, 0) for le, n in le1.items()},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="hybrid8_resident", choices=sorted(WORKLOADS))
    p.add_argument(
        "--model", default=None, help="serve this model directory with --extra-flags instead of the workload's"
    )
    p.add_argument("--extra-flags", default="", help="more `ferry serve` flags, space-separated")
    p.add_argument("--streams", default="1,8")
    p.add_argument("--seconds", type=float, default=6)
    p.add_argument(
        "--settle-seconds",
        type=float,
        default=4,
        help="decoding before the sampled window (auto's guard explores its share over ~1,000 steps)",
    )
    p.add_argument("--max-tokens", type=int, default=2048, help="each stream's completions (back to back)")
    p.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    p.add_argument(
        "--idle",
        action="store_true",
        help="sample threads off the CPU too (py-spy --idle): `busy` is then 1, and `self` says where each waits",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--ready-timeout", type=float, default=900)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ferry-profile-serve-"))
    os.environ["FERRY_STEP_TRACE"] = str(tmp / "trace")  # the served processes inherit it
    if args.model:
        model_dir, flags = args.model, []
    else:
        model_dir, flags, _ = workload_model(args.workload, tmp / "model")
    served = start_serve(model_dir, [*flags, *args.extra_flags.split()], tmp / "serve.log")
    result = {
        "workload": args.workload,
        "serve": served.command,
        "commit": commit(),
        "rate": args.rate,
        "seconds": args.seconds,
        "runs": [],
    }
    try:
        served.wait_ready(args.ready_timeout)
        for n in (int(s) for s in args.streams.split(",")):
            result["runs"].append(
                profile(
                    served,
                    args.py_spy,
                    n,
                    args.max_tokens,
                    args.seconds,
                    args.rate,
                    args.top,
                    tmp,
                    tmp / "trace",
                    ("--idle",) if args.idle else (),
                    args.settle_seconds,
                )
            )
            print(
                json.dumps(
                    {
                        k: v
                        for k, v in result["runs"][-1].items()
                        if k in ("streams", "tokens_per_s", "step_ms", "timeline", "host_nodes")
                    }
                ),
                flush=True,
            )
    finally:
        served.stop()
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        if os.environ.get("FERRY_KEEP_SERVE_LOG"):
            shutil.copy(tmp / "serve.log", os.environ["FERRY_KEEP_SERVE_LOG"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
