"""Speculative decoding's decode speed at set acceptance rates, against speculation off, with an ORACLE DRAFT
(bench-only: services/scheduler/oracle_drafter.py): the drafts are the target's own greedy continuation, each
token corrupted at rate 1 - alpha, so a verify keeps a draft with chance alpha given the ones before it were.
What the draft-length controller (services/scheduler/draft_length.py) makes of a known acceptance, apart from how
well prompt lookup guesses; alpha 0 is the case it must not lose (>= 0.97x speculation off).

For a decode_suite workload (a bench model with dummy weights, its serve flags): `ferry serve` with speculation
off and FERRY_BENCH_RECORD_SEQUENCES records each prompt's greedy output while the baseline is measured; then for
each alpha `ferry serve --speculative-method ngram` (or mtp: the MTP head drafts for real, its cost paid, and the
oracle's tokens replace its drafts) with FERRY_BENCH_ORACLE_DRAFTS (that record) and
FERRY_BENCH_ORACLE_ALPHA. Each run: the same token-id prompts (each sent once first, so its prefix is cached), one
stream at a time, greedy, ignore_eos; per stream the tokens over the request's whole time (`median_e2e_tok_s`, the
figure compared: a verify's tokens arrive in one chunk, which a rate between chunks would misread) and
bench/serve_openai.py's chunk rate beside it, with the scheduler's acceptance and mean k from /metrics, its steps and
how many went ahead of the answer before them, whether the text matched speculation off's, and from the server's
step trace (FERRY_STEP_TRACE, OUT/trace_<run>/) the measured steps by kind (`steps_by_kind`: plain, drafting, and
rows of several tokens without drafts), each kind's seconds and its steps' interval, device and idle times: where a
drafting run's time goes besides what the controller prices. Writes OUT/spec_oracle_<workload>.json.

    python3 -m bench spec-oracle --out out --workload 12layer [--alphas 0,0.6,0.8,0.9] [--speculative-tokens 4]
    python3 -m bench spec-oracle --out out --model DIR --serve-flags="--device cpu"   (a model of your own)
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decode_suite import WORKLOADS, commit, workload_model  # noqa: E402
from bench.profile_serve import median_of_present, trace_lines  # noqa: E402
from bench.serve_openai import prompt_ids, stream, timed_http_client  # noqa: E402
from bench.serve_process import start_serve  # noqa: E402
from ferry.shared.liveness import HEARTBEAT_INTERVAL_S  # noqa: E402
from ferry.shared.step_trace import ENV as STEP_TRACE_ENV  # noqa: E402

LABEL = (
    "oracle draft at set acceptance rates (bench-only): drafts are the target's greedy continuation, each token "
    "corrupted at rate 1 - alpha"
)
# the api's counts are the scheduler's as of its last status (every HEARTBEAT_INTERVAL_S): wait for a newer one
COUNTS_SETTLE_S = 4 * HEARTBEAT_INTERVAL_S
COUNTERS = (
    "ferry_speculative_drafted_tokens_total",
    "ferry_speculative_accepted_tokens_total",
    "ferry_speculative_k_decisions_total",
    "ferry_speculative_k_chosen_total",
    "ferry_speculative_estimated_misses_added_total",
)


# the step costs the controller prices with, as the worker times them (gauges: their values at the run's end)
GAUGES = (
    "ferry_speculative_decode_step_seconds",
    "ferry_speculative_chain_position_seconds",
    "ferry_speculative_verify_step_seconds",
    "ferry_speculative_verify_wall_seconds",
)
# the scheduler's steps, and those sent ahead of the previous step's answer: a decode that stops being scheduled
# ahead waits a scheduler turn and two hops a step
STEP_COUNTERS = ("ferry_scheduler_steps_total", "ferry_scheduler_steps_ahead_total")


def counters(url: str, names: tuple[str, ...] = COUNTERS + GAUGES) -> dict[str, float]:
    """These series of the /metrics at `url` (default: the api's speculative counters and gauges), 0 where
    absent."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    got = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in got:
            got[name] = float(value)
    return got


def step_kinds(worker: list[dict], t0: float, t1: float) -> dict:
    """The steps the worker answered within [t0, t1] by kind, from its trace lines (shared/step_trace.py): `plain`
    (one token a row), `drafting` (rows with drafts), `several` (rows of several tokens without drafts: a prompt's
    tail after its cached prefix, a hybrid's kept drafts computed again). For each: how many, the seconds they took
    (each from the answer before it to its own: what it cost the stream; a request's first step also carries the
    client's pause before it, which the medians leave out), and medians (ms) of that, of its time on
    the device and of the device's idle time before it; `longest_row`: the most tokens a row of that kind had."""
    steps = sorted((e for e in worker if t0 <= e["answered"] <= t1), key=lambda e: e["answered"])
    kinds: dict[str, list] = {"plain": [], "drafting": [], "several": []}
    for before, e in zip(steps, steps[1:]):
        longest = e.get("longest", -(-e["tokens"] // max(e["rows"], 1)))
        kind = "drafting" if e.get("drafts", 0) else "plain" if longest <= 1 else "several"
        kinds[kind].append((1e3 * (e["answered"] - before["answered"]), e["device_ms"], e["idle_ms"], longest))

    def ms(values: list) -> float | None:
        m = median_of_present(values)
        return None if m is None else round(m, 3)

    return {
        kind: {
            "steps": len(got),
            "seconds": round(sum(g[0] for g in got) / 1e3, 4),
            "interval_ms": ms([g[0] for g in got]),
            "device_ms": ms([g[1] for g in got]),
            "device_idle_ms": ms([g[2] for g in got]),
            "longest_row": max((g[3] for g in got), default=0),
        }
        for kind, got in kinds.items()
    }


def kinds_line(run: dict) -> str:
    """A run's `steps_by_kind`, one line: each kind's steps, seconds and median interval (device) ms."""
    kinds = run.get("steps_by_kind") or {}
    return ", ".join(
        f"{kind} {k['steps']} steps {k['seconds']} s at {k['interval_ms']} ms (device {k['device_ms']}, "
        f"rows up to {k['longest_row']})"
        for kind, k in kinds.items()
        if k["steps"]
    )


def measure(served, prompts: list[list[int]], args) -> dict:
    """Each prompt streamed `args.repeats` times, one at a time: per-stream decode tok/s, texts, counters, and the
    measured window's steps by kind (`step_kinds`) where the server traced its steps."""
    import openai

    client = openai.OpenAI(base_url=served.base + "/v1", api_key="bench", http_client=timed_http_client())
    model = client.models.list().data[0].id
    for p in prompts:  # a warm-up: the first request's compiles are not decode, and each prompt is then cached
        stream(client, model, p, 8, 0.0)
    time.sleep(COUNTS_SETTLE_S)
    before = counters(served.base + "/metrics")
    steps_before = counters(served.scheduler_metrics, STEP_COUNTERS)
    t0 = time.monotonic()  # the clock of the trace's lines (CLOCK_MONOTONIC, one for every process of the host)
    rates, e2e, texts = [], [], []
    for p in prompts:
        for _ in range(args.repeats):
            r = stream(client, model, p, args.max_tokens, 0.0)
            rates.append(r["tok_s"])
            e2e.append(r["tokens"] / r["last_s"] if r["last_s"] else None)
            texts.append(r["text"])
    t1 = time.monotonic()
    time.sleep(COUNTS_SETTLE_S)
    after = counters(served.base + "/metrics")
    steps = {k: v - steps_before[k] for k, v in counters(served.scheduler_metrics, STEP_COUNTERS).items()}
    d = {k: after[k] - before[k] for k in COUNTERS}
    drafted = d["ferry_speculative_drafted_tokens_total"]
    decisions = d["ferry_speculative_k_decisions_total"]
    return {
        "median_e2e_tok_s": round(statistics.median(r for r in e2e if r), 2),
        "median_stream_tok_s": round(statistics.median(r for r in rates if r), 2),
        "per_stream_tok_s": [round(r, 2) if r else None for r in rates],
        "acceptance": round(d["ferry_speculative_accepted_tokens_total"] / drafted, 3) if drafted else None,
        "mean_k": round(d["ferry_speculative_k_chosen_total"] / decisions, 3) if decisions else None,
        "drafted_tokens": drafted,
        "estimated_misses_added": d["ferry_speculative_estimated_misses_added_total"],
        "decode_step_ms": round(1e3 * after["ferry_speculative_decode_step_seconds"], 3),
        "chain_position_ms": round(1e3 * after["ferry_speculative_chain_position_seconds"], 3),
        "verify_step_ms": round(1e3 * after["ferry_speculative_verify_step_seconds"], 3),
        "verify_wall_ms": round(1e3 * after["ferry_speculative_verify_wall_seconds"], 3),
        "steps": steps["ferry_scheduler_steps_total"],
        "steps_ahead": steps["ferry_scheduler_steps_ahead_total"],
        "texts": texts,
        "window": (t0, t1),
    }


def serve_and_measure(tag: str, model_dir: Path, flags: list[str], env: dict, prompts, out: Path, args) -> dict:
    trace = out / f"trace_{tag}"  # each run's step timeline (FERRY_STEP_TRACE), read once the server has stopped
    shutil.rmtree(trace, ignore_errors=True)
    trace.mkdir(parents=True)
    served = start_serve(model_dir, flags, out / f"serve_{tag}.log", env={**env, STEP_TRACE_ENV: str(trace)})
    print(f"[{tag}] {served.command}", flush=True)
    try:
        served.wait_ready(args.ready_timeout)
        result = measure(served, prompts, args)
    finally:
        result_stop = served.stop()
    result["steps_by_kind"] = step_kinds(trace_lines(trace, "worker"), *result.pop("window"))
    return {"serve": served.command, **result, "stopped": result_stop}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    # the decode workloads of a config (a long prompt or a GGUF file's own tokenizer are not this bench's)
    decode = [w for w, (_, _, _, *fmt) in WORKLOADS.items() if not w.startswith("long") and "gguf" not in str(fmt)]
    p.add_argument("--workload", default="12layer", choices=decode)
    p.add_argument("--alphas", default="0,0.6,0.8,0.9", help="the oracle's acceptance rates, comma-separated")
    p.add_argument("--speculative-tokens", type=int, default=4, help="K: drafts a row carries at most")
    p.add_argument(
        "--speculative-method",
        default="ngram",
        choices=("ngram", "mtp"),
        help="the drafter the oracle's tokens replace: mtp runs the model's MTP head each step (a model with one)",
    )
    p.add_argument(
        "--pinned-drafts",
        default="",
        help="also run each alpha with every drafting row given this k (comma-separated; FERRY_BENCH_PINNED_DRAFTS): "
        "what a fixed k yields beside the controller's choice",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="mtp: the speculative runs' --speculative-draft-vocab (the chain drafts among the first N ids; 0: all)",
    )
    p.add_argument("--prompts", type=int, default=3, help="distinct token-id prompts")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="streams of each prompt per run")
    p.add_argument("--model", type=Path, help="serve this model directory (its weights) instead of the workload's")
    p.add_argument("--serve-flags", default="", help="serve flags with --model (e.g. '--device cpu')")
    p.add_argument("--ready-timeout", type=float, default=900)
    args = p.parse_args()
    alphas = [float(a) for a in args.alphas.split(",")]
    pinned = [int(k) for k in args.pinned_drafts.split(",") if k.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is not None:
        model_dir, flags = args.model, shlex.split(args.serve_flags)
        args.workload = args.model.name
    else:
        model_dir, flags, _ = workload_model(
            args.workload, Path(tempfile.mkdtemp(prefix="ferry-bench-")) / args.workload
        )
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    draw = prompt_ids(vocab, seed=0)
    prompts = [draw(args.prompt_len) for _ in range(args.prompts)]
    record = args.out / f"spec_oracle_{args.workload}_sequences.jsonl"
    record.unlink(missing_ok=True)
    bench_env = {"FERRY_BENCH_ONLY": "1"}
    recording = {**bench_env, "FERRY_BENCH_RECORD_SEQUENCES": str(record)}
    off = serve_and_measure("spec_off", model_dir, flags, recording, prompts, args.out, args)
    runs = []
    spec = ["--speculative-method", args.speculative_method, "--speculative-tokens", str(args.speculative_tokens)]
    spec += ["--speculative-draft-vocab", str(args.draft_vocab)] if args.draft_vocab else []
    for alpha, k in [(alpha, k) for alpha in alphas for k in [0, *pinned]]:
        env = {**bench_env, "FERRY_BENCH_ORACLE_DRAFTS": str(record), "FERRY_BENCH_ORACLE_ALPHA": str(alpha)}
        tag = f"spec_oracle_{alpha:g}" + (f"_pinned{k}" if k else "")
        pinned_k = f" pinned k {k}" if k else ""
        if k:
            env["FERRY_BENCH_PINNED_DRAFTS"] = str(k)
        try:
            run = serve_and_measure(tag, model_dir, [*flags, *spec], env, prompts, args.out, args)
        except Exception as exc:  # a run that did not serve (or died serving) is recorded as such; the others count
            runs.append({"alpha": alpha, "pinned_drafts": k or None, "error": str(exc), "log": f"serve_{tag}.log"})
            print(
                f"[{args.workload}] oracle alpha {alpha:g}{pinned_k}: did not serve ({exc}; serve_{tag}.log)",
                flush=True,
            )
            continue
        run["alpha"] = alpha
        run["pinned_drafts"] = k or None  # None: the controller chose k
        run["vs_off"] = round(run["median_e2e_tok_s"] / off["median_e2e_tok_s"], 3)
        run["vs_off_stream"] = round(run["median_stream_tok_s"] / off["median_stream_tok_s"], 3)
        run["same_text_as_off"] = run.pop("texts") == off["texts"]
        runs.append(run)
        print(
            f"[{args.workload}] oracle alpha {alpha:g}{pinned_k}: {run['median_e2e_tok_s']} "
            f"tok/s = {run['vs_off']}x off (between chunks {run['vs_off_stream']}x) "
            f"({off['median_e2e_tok_s']} tok/s); acceptance {run['acceptance']}, mean k {run['mean_k']}, "
            f"same text {run['same_text_as_off']}; step {run['decode_step_ms']} ms, chain position "
            f"{run['chain_position_ms']} ms, verify step {run['verify_step_ms']} ms "
            f"({run['verify_wall_ms']} ms send to answer); {run['steps_ahead']:g} of "
            f"{run['steps']:g} steps ahead (off: {off['steps_ahead']:g} of {off['steps']:g}); {kinds_line(run)}",
            flush=True,
        )
    off.pop("texts")
    result = {
        "label": LABEL,
        "workload": args.workload,
        "speculative_tokens": args.speculative_tokens,
        "speculative_method": args.speculative_method,
        "draft_vocab": args.draft_vocab or None,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "off": off,
        "oracle": runs,
        "commit": commit(),
    }
    (args.out / f"spec_oracle_{args.workload}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 1 if any("error" in run for run in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
