"""Where a served prompt's time to first token goes, phase by phase, from the client's send to its first
streamed chunk: one-token completions (streamed, as bench/serve_openai.py's TTFT) sent one at a time, each a
fresh prompt (no prefix cache hit), as token ids and as text, against the step timeline the api, the
scheduler and the worker write under FERRY_STEP_TRACE (shared/step_trace.py: CLOCK_MONOTONIC in every
process of the host, this one too, so the lines line up).

Phases (ms, medians over the runs of each prompt kind):

    http_in           the client's send to the route handler (connection, headers, body read)
    parse             handler to the tokenizer lane (body decode, validation)
    tokenize          the lane: the hop to its thread, tokenizing (ids: their range check), the hop back
    to_submit         tokenized to the Submit's encoding (the Generation, the sampling)
    api_to_scheduler  the Submit's encoding, its send and hop, the scheduler's read of it
    admit             the scheduler's checks and queueing of the request
    hold              queued to its step handed to the socket: the arrival hold (--prefill-coalesce-ms, with
                      experts offloaded), the wake-up after it, scheduling
    to_worker         the step's encoding, send and hop, the worker's read of it
    worker_launch     the worker's launch: its checks, the request's sampler state, the inputs, the whole
                      forward's enqueueing (on the CPU, the whole step)
    worker_wait       launch to answer: the device finishing, the worker noticing, its StepDone built
    to_scheduler      the answer's send and hop, the scheduler's read
    to_api            the scheduler's turn (the next step first) and the Tokens' hop to the api
    api_out           the first token read to its chunk made (detokenizing, the SSE chunk)
    http_out          the chunk's write to the client reading it

    python3 bench/ttft_path.py --workload 12layer --out out/ttft_path_12layer.json
    python3 bench/ttft_path.py --model DIR --extra-flags "--device cpu --moe-cache-size 12" --out ttft.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serve_openai import id_range, text_of_tokens  # noqa: E402
from bench.serve_process import start_serve  # noqa: E402

PHASES = (
    "http_in",
    "parse",
    "tokenize",
    "to_submit",
    "api_to_scheduler",
    "admit",
    "hold",
    "to_worker",
    "worker_launch",
    "worker_wait",
    "to_scheduler",
    "to_api",
    "api_out",
    "http_out",
)


def one_token(port: int, prompt, max_tokens: int = 1) -> tuple[float, float]:
    """(monotonic send time, monotonic arrival of the first chunk) of a streamed completion (one token by default)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.connect()
        sent = time.monotonic()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        first = None
        while line := response.readline():
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic()
            if line.startswith(b"data: [DONE]"):
                break
        return sent, first
    finally:
        conn.close()


def lines(trace_dir: Path, role: str) -> list[dict]:
    out = []
    for path in trace_dir.glob(f"{role}-*.jsonl"):
        out.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return out


def phases(sent: float, first: float, api: list[dict], scheduler: list[dict], worker: list[dict]) -> dict | None:
    """One request's phases (ms) from the trace lines in [sent, first], or None when a line is missing (the
    requests go one at a time, so the window holds this request's lines alone)."""

    def within(rows: list[dict], key: str) -> list[dict]:
        return [r for r in rows if key in r and sent <= r[key] <= first + 1.0]

    try:
        handler = within(api, "handler")[0]["handler"]
        tok = within(api, "tokenize")[0]
        sub = within(api, "submit")[0]
        arrived = next(r for r in scheduler if r.get("req") == sub["req"] and "arrived" in r and r["arrived"] >= sent)
        step = next(r for r in scheduler if "sent" in r and arrived["rid"] in r.get("rids", ()) and r["sent"] >= sent)
        work = next(r for r in worker if r["step"] == step["step"])
        landed = next(r["landed"] for r in scheduler if r.get("step") == step["step"] and "landed" in r)
        tokens = next(r["first_token"] for r in within(api, "first_token") if r["req"] == sub["req"])
        written = within(api, "first_write")[0]["first_write"]
    except (IndexError, StopIteration):
        return None
    marks = [
        sent,
        handler,
        tok["tokenize"],
        tok["tokenized"],
        sub["submit"],
        arrived["received"],
        arrived["arrived"],
        step["sent"],
        work["recv"],
        work["launched"],
        work["answered"],
        landed,
        tokens,
        written,
        first,
    ]
    out = {name: round(1e3 * (b - a), 3) for name, a, b in zip(PHASES, marks, marks[1:])}
    out["total"] = round(1e3 * (first - sent), 3)
    out["outside_step"] = round(out["total"] - out["worker_launch"] - out["worker_wait"], 3)
    out["prompt_tokens"] = sub.get("prompt_tokens")
    # on CUDA the worker times the step on the device too: its device time, against worker_launch + worker_wait
    # (a step whose host enqueue paces it spends the difference with the device waiting)
    out["step_device_ms"] = work.get("device_ms")
    return out


def summary(runs: list[dict]) -> dict:
    """Each phase's median (ms) over the runs; the device's step time only where it was timed (CUDA)."""
    keys = (*PHASES, "total", "outside_step", "step_device_ms")
    out = {}
    for k in keys:
        values = [r[k] for r in runs if r.get(k) is not None]
        out[k] = round(statistics.median(values), 3) if values else None
    return out


def main() -> int:
    from bench.decode_suite import WORKLOADS, workload_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="12layer", choices=sorted(WORKLOADS))
    p.add_argument(
        "--model", default=None, help="serve this model directory with --extra-flags instead of the workload's"
    )
    p.add_argument("--extra-flags", default="", help="more `ferry serve` flags, space-separated")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--runs", type=int, default=5, help="timed requests of each prompt kind (ids, text), alternating")
    p.add_argument("--gap-s", type=float, default=0.5, help="idle time before each request (nothing held or running)")
    p.add_argument(
        "--warm-tokens",
        type=int,
        default=16,
        help="one untimed stream of this many tokens first, as bench/serve_openai.py's warm-up "
        "(decode steps ran before the prompts, as in its TTFT)",
    )
    p.add_argument("--out", required=True)
    p.add_argument("--ready-timeout", type=float, default=900)
    args = p.parse_args()
    import numpy as np

    tmp = Path(tempfile.mkdtemp(prefix="ferry-ttft-path-"))
    trace_dir = tmp / "trace"
    if args.model:
        model_dir, flags = Path(args.model), []
    else:
        model_dir, flags, _ = workload_model(args.workload, tmp / "model")
    served = start_serve(
        model_dir, [*flags, *args.extra_flags.split()], tmp / "serve.log", env={"FERRY_STEP_TRACE": str(trace_dir)}
    )
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    low, high = id_range(vocab)
    rng = np.random.default_rng(int(time.time()))  # fresh prompts: none is in a cache from an earlier run
    result = {"serve": served.command, "prompt_len": args.prompt_len, "runs": {"ids": [], "text": []}}
    times = {"ids": [], "text": []}
    try:
        served.wait_ready(args.ready_timeout)
        if args.warm_tokens:
            one_token(served.port, rng.integers(low, high, 32).tolist(), args.warm_tokens)
        one_token(served.port, rng.integers(low, high, args.prompt_len).tolist())  # the first of this length: untimed
        for _ in range(args.runs):
            for kind in ("ids", "text"):
                prompt = rng.integers(low, high, args.prompt_len).tolist()
                if kind == "text":
                    prompt = text_of_tokens(str(model_dir), args.prompt_len, rng, low, high)
                    if prompt is None:
                        continue
                time.sleep(args.gap_s)
                times[kind].append(one_token(served.port, prompt))
    finally:
        result["stopped"] = served.stop()  # each process writes the trace lines it holds as it stops
        if os.environ.get("FERRY_KEEP_SERVE_LOG"):
            shutil.copy(tmp / "serve.log", os.environ["FERRY_KEEP_SERVE_LOG"])
    api, scheduler, worker = (lines(trace_dir, role) for role in ("api", "scheduler", "worker"))
    for kind, pairs in times.items():
        runs = [r for r in (phases(s, f, api, scheduler, worker) for s, f in pairs) if r is not None]
        result["runs"][kind] = runs
        result[f"median_{kind}_ms"] = summary(runs)
        print(kind, json.dumps(result[f"median_{kind}_ms"]), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
