"""End-to-end decode through the worker (boot + executor, the code `ferry serve` runs), with the
bound next to each figure.

For a model's config.json with `--load-format dummy`: boot exactly as the worker does under a
device budget (default `--gpu-memory 24GiB`), then

* TTFT: one request with a `--prompt-len` (2048) token prompt, prefilled in `max_prefill_tokens`
  chunks, until its first token is on the host;
* decode: `--decode-tokens` (256) steps for 1 stream and for N streams (`--streams 1,8`);

and report tokens/s, per-token time (median), expert-cache hit rate, bytes copied per token,
the peak device memory reserved (never above --gpu-memory), and the bound per decode step:

    time >= missed expert bytes / pinned H2D bandwidth
            + (dense weights + experts computed + KV read + linear state read/written) / HBM bandwidth

with both bandwidths measured on this device (bench/bandwidth.py) after the run. Every step's
output tokens reach the host, so per-step wall time (perf_counter around execute) is what a
client sees from the worker. Prints a table, writes JSON (--out).

    python3 bench/serve_decode.py --model tests/data/models/qwen3-30b-a3b --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from ferry.services.worker.boot import boot_worker  # noqa: E402
from ferry.services.worker.flags import add_worker_flags, boot_config_from_args  # noqa: E402
from ferry.shared.sampling import SamplingParams  # noqa: E402
from ferry.shared.step import NewRequest, StepBatch  # noqa: E402
from ferry.shared.units import GiB, ceil_div, format_bytes  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


class Streams:
    """Requests with fixed page ranges and linear-state slots, stepped together (what the scheduler does)."""

    def __init__(self, executor, count: int, max_len: int, first_req_id: int):
        plan = executor.plan
        self.executor, self.page_size = executor, plan.kv.page_size
        self.pages_each = ceil_div(max_len, self.page_size)
        if count * self.pages_each > plan.kv.pages:
            raise SystemExit(
                f"{count} streams of {max_len} tokens need {count * self.pages_each} KV pages; "
                f"the plan has {plan.kv.pages}"
            )
        if plan.linear_state.slots and count > plan.linear_state.slots:
            raise SystemExit(f"{count} streams need {count} linear-state slots; the plan has {plan.linear_state.slots}")
        self.req_ids = list(range(first_req_id, first_req_id + count))
        self.context = [0] * count
        self.step_id = first_req_id * 100_000

    def step(
        self,
        tokens: list[list[int]],
        sample: bool,
        new: list[NewRequest] | None = None,
        finished: list[int] | None = None,
        **speculation,
    ):
        """One step of these tokens a row; `speculation`: StepBatch's drafting fields (draft_lens, hold_state,
        mtp_drafts), as the scheduler gives a verify step. The contexts advance by the rows' tokens."""
        n = len(self.req_ids)
        table = np.zeros((n, self.pages_each), dtype=np.int32)
        for i in range(n):
            table[i] = np.arange(1 + i * self.pages_each, 1 + (i + 1) * self.pages_each)
        self.step_id += 1
        batch = StepBatch(
            step_id=self.step_id,
            req_ids=np.array(self.req_ids, dtype=np.int64),
            tokens=np.array([t for ts in tokens for t in ts], dtype=np.int32),
            query_lens=np.array([len(ts) for ts in tokens], dtype=np.int32),
            context_lens=np.array(self.context, dtype=np.int32),
            page_table=table,
            linear_state_slots=np.arange(1, n + 1, dtype=np.int32),
            reset_linear_state=np.array([c == 0 for c in self.context]),
            sample=np.array([sample] * n),
            new_requests=tuple(new or ()),
            finished_req_ids=tuple(finished or ()),
            **speculation,
        )
        out = self.executor.execute(batch)
        self.context = [c + len(ts) for c, ts in zip(self.context, tokens)]
        return out

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        new = [
            NewRequest(req_id=r, prompt_token_ids=np.array(p, dtype=np.int32), sampling=GREEDY)
            for r, p in zip(self.req_ids, prompts)
        ]
        chunk = max(1, self.executor.plan.max_prefill_tokens // len(prompts))
        done = 0
        while done < len(prompts[0]):
            part = [p[done : done + chunk] for p in prompts]
            last = done + len(part[0]) >= len(prompts[0])
            out = self.step(part, sample=last, new=new)
            new, done = [], done + len(part[0])
        return out.token_ids.tolist()

    def finish(self) -> None:
        self.executor.execute(StepBatch.empty(step_id=self.step_id + 1, finished_req_ids=tuple(self.req_ids)))


def _cache_counters(executor) -> dict:
    report = executor.expert_cache_report()
    return {k: report[k] for k in ("hits", "misses", "bytes_copied")}


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def decode(executor, streams: Streams, first_tokens: list[int], steps: int, rng=None) -> dict:
    """`steps` decode steps; per-step wall times and the cache counters over them.

    With `rng`, each step feeds random token ids instead of the sampled ones: a model with
    dummy weights repeats one token forever, so its routing never changes and every expert
    lookup after the first step would hit, which no real model does."""
    tokens = first_tokens
    before = _cache_counters(executor)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = streams.step([[t] for t in tokens], sample=True)
        tokens = out.token_ids.tolist()  # on the host: the step is complete
        if rng is not None:
            tokens = rng.integers(0, executor.spec.vocab_size, size=len(tokens)).tolist()
        times.append(time.perf_counter() - t0)
    counters = _delta(_cache_counters(executor), before)
    mean_context = statistics.mean(streams.context) - steps / 2
    return {"step_seconds": times, "counters": counters, "mean_context": mean_context}


def hbm_bytes_per_step(executor, counters: dict, steps: int, streams: int, mean_context: float) -> float:
    """Bytes a decode step must read from (or write to) HBM at the least."""
    plan, spec = executor.plan, executor.spec
    itemsize = 2 if plan.dtype in ("bfloat16", "float16") else 4
    embedding = spec.vocab_size * spec.hidden_size * itemsize  # gathered row by row, not read whole
    dense = plan.weights_bytes - embedding
    experts = (counters["hits"] + counters["misses"]) / steps * plan.experts.bytes_per_slot
    kv = streams * mean_context * plan.kv.bytes_per_token
    linear = 2 * streams * plan.linear_state.bytes_per_slot
    return dense + experts + kv + linear


def summarize(executor, run: dict, streams: int, h2d: float, hbm: float) -> dict:
    steps = len(run["step_seconds"])
    median = statistics.median(run["step_seconds"])
    mean = statistics.mean(run["step_seconds"])
    c = run["counters"]
    copied_per_step = c["bytes_copied"] / steps
    hbm_per_step = hbm_bytes_per_step(executor, c, steps, streams, run["mean_context"])
    bound = copied_per_step / h2d + hbm_per_step / hbm
    lookups = c["hits"] + c["misses"]
    return {
        "streams": streams,
        "steps": steps,
        "median_step_ms": 1e3 * median,
        "p90_step_ms": 1e3 * sorted(run["step_seconds"])[int(0.9 * (steps - 1))],
        "mean_step_ms": 1e3 * mean,
        "tokens_per_s": streams / mean,
        "hit_rate": c["hits"] / lookups if lookups else 1.0,
        "bytes_copied_per_token": copied_per_step / streams,
        "hbm_bytes_per_step": hbm_per_step,
        "bound_step_ms": 1e3 * bound,
        "bound_fraction": bound / mean,  # average bound over average step time; 1.0 = at the bound
        "counters": c,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_worker_flags(parser)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--streams", default="1,8", help="comma-separated stream counts to decode with")
    parser.add_argument("--stream-prompt-len", type=int, default=128, help="prompt length of multi-stream runs")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--decode-inputs",
        choices=("random", "sampled"),
        default="random",
        help="feed random token ids (routing varies as in a real model) or the sampled ones",
    )
    parser.set_defaults(load_format="dummy", gpu_memory=24 * GiB, max_model_len=8192, max_running_requests=8)
    args = parser.parse_args()
    stream_counts = [int(s) for s in args.streams.split(",")]
    if args.kv_reserve_tokens is None and args.num_tokens is None and args.num_pages is None:
        # a KV floor that holds every run's streams (pages are handed out per stream, rounded up)
        page = args.page_size or 16
        need = [args.prompt_len + args.decode_tokens + 1]
        need += [n * (args.stream_prompt_len + args.decode_tokens + 1 + page) for n in stream_counts]
        args.kv_reserve_tokens = max(need) + page

    torch.manual_seed(0)
    t0 = time.perf_counter()
    executor, plan = boot_worker(boot_config_from_args(args))
    boot_s = time.perf_counter() - t0
    device = executor.device
    cuda = torch.device(device).type == "cuda"
    rng = np.random.default_rng(0)
    vocab = executor.spec.vocab_size
    decode_rng = np.random.default_rng(1) if args.decode_inputs == "random" else None

    # TTFT of one long prompt, then single-stream decode continuing it
    results = {"model": args.model, "plan": plan.to_dict(), "boot_seconds": boot_s}
    runs = {}
    # warm-up: one throwaway prompt of the same length and a few decode steps, so that kernel
    # compilation and autotuning (Triton, fla) stay out of TTFT and the decode figures
    warm = Streams(executor, 1, args.prompt_len + 8, first_req_id=900)
    decode(executor, warm, warm.prefill([rng.integers(0, vocab, size=args.prompt_len).tolist()]), 4)
    warm.finish()
    one = Streams(executor, 1, args.prompt_len + args.decode_tokens + 1, first_req_id=1)
    prompt = rng.integers(0, vocab, size=args.prompt_len).tolist()
    before = _cache_counters(executor)
    t0 = time.perf_counter()
    first = one.prefill([prompt])
    results["ttft_s"] = time.perf_counter() - t0
    results["ttft_counters"] = _delta(_cache_counters(executor), before)
    if 1 in stream_counts:
        runs[1] = decode(executor, one, first, args.decode_tokens, decode_rng)
    one.finish()
    for n in [s for s in stream_counts if s != 1]:
        many = Streams(executor, n, args.stream_prompt_len + args.decode_tokens + 1, first_req_id=10 + n)
        first = many.prefill([rng.integers(0, vocab, size=args.stream_prompt_len).tolist() for _ in range(n)])
        runs[n] = decode(executor, many, first, args.decode_tokens, decode_rng)
        many.finish()

    peak = torch.cuda.max_memory_reserved(device) if cuda else None
    results["peak_reserved_bytes"] = peak
    results["gpu_memory_bytes"] = args.gpu_memory
    if cuda:
        from bench.bandwidth import measure

        torch.cuda.empty_cache()
        ceilings = measure(512 << 20)
        h2d, hbm = ceilings["h2d_pinned_GBps"] * 1e9, ceilings["hbm_copy_GBps"] * 1e9
    else:
        ceilings, h2d, hbm = {"note": "CPU run: bounds use nominal 55 GB/s and 4.2 TB/s"}, 55e9, 4.2e12
    results["ceilings"] = ceilings
    results["decode"] = [summarize(executor, runs[n], n, h2d, hbm) for n in sorted(runs)]

    print(
        f"model {args.model}  boot {boot_s:.1f}s  peak reserved "
        f"{format_bytes(peak) if peak is not None else 'n/a'} of {format_bytes(args.gpu_memory)}  "
        f"expert slots {plan.experts.slots}/{plan.experts.total}"
    )
    print(f"TTFT ({args.prompt_len}-token prompt): {results['ttft_s'] * 1e3:.0f} ms")
    print(
        f"{'streams':>7} {'tok/s':>8} {'mean ms':>8} {'bound ms':>9} {'bound/meas':>10} {'hit rate':>8} "
        f"{'MiB copied/tok':>14}"
    )
    for d in results["decode"]:
        print(
            f"{d['streams']:>7} {d['tokens_per_s']:>8.2f} {d['mean_step_ms']:>8.2f} {d['bound_step_ms']:>9.2f} "
            f"{d['bound_fraction']:>10.2f} {d['hit_rate']:>8.3f} {d['bytes_copied_per_token'] / 2**20:>14.1f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if peak is not None and peak > args.gpu_memory:
        print(f"FAIL: peak reserved {peak} > --gpu-memory {args.gpu_memory}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
