"""Decode and TTFT measured as a user sees them: the official `openai` client streaming from any
OpenAI-compatible server (Ferry, or a peer measured with the very same script).

* TTFT: one completion of max_tokens 1 with a `--ttft-prompt-len` token prompt, time to the first
  streamed chunk (median of `--ttft-runs`), from the call into the client (`ttft_s`) and from the
  moment the HTTP request leaves it (`ttft_wire_s`, an httpx request hook). The prompt is text, as
  people send it, which the server tokenizes: with the model directory's tokenizer (`--tokenizer`,
  default `--config`) the text is built to be exactly that many tokens, and the server's
  `usage.prompt_tokens` is recorded to show it. The same is measured with the prompt sent as token
  ids (`ttft_ids_s`, `ttft_ids_wire_s`): there the openai client spends 20-40 ms building the
  request of 2,000 ids before it sends it. Without a tokenizer (or when no text of exactly that
  many tokens is found) only the ids are sent. One untimed prompt of that length goes first, and
  the text and ids runs alternate. `--prompt-kind text` sends every prompt as text (the decode runs'
  too, each exactly `--prompt-len` tokens) and no ids, for servers that take only text (FreeToken);
* decode: for each N in `--streams`, N concurrent streamed completions of `--max-tokens` tokens at
  `--temperature` with `ignore_eos`; per stream, tokens/s from chunk arrival times (the tokens
  after the first over the time between the first and the last chunk), and the aggregate
  (all tokens over the wall time from the first chunk to the last). Each N runs `--repeats` times
  back to back (default 3) and reports the median repeat: one 128-token stream is half a second,
  and two servers of the same code gave 261.6 and 196.5 tok/s from one repeat each, the second
  while the host's share ran slow for that half second.

With `--metrics URL` (Ferry's worker /metrics), the expert cache's counters over each run: hit
rate, prefetch accuracy and bytes copied per token. With `--config DIR --ceilings JSON` as well
(the model's config.json and bench/bandwidth.py's output, measured in the same run), the bound
per token next to each single-stream figure:

    expert bytes that had to cross (misses + prefetched experts that were used) / pinned H2D
    + (dense weights read + routed experts computed + KV read) / HBM

An expert's bytes on the wire are what the server reports it copied per expert (packed banks:
12 bits a value, about 0.75 of bf16), so the bound is what PCIe allows for the bytes that really
cross; `bound_bf16_tok_s` is the same with bf16 experts (plain banks' bound).

    python3 bench/serve_openai.py --base-url http://127.0.0.1:8000/v1 --streams 1,8 --out run.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def scrape(url: str | None) -> dict[str, float]:
    """Counter samples of a Prometheus text page (name -> value, `_total` names)."""
    if not url:
        return {}
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def cache_delta(before: dict, after: dict) -> dict | None:
    p = "ferry_worker_expert_"
    if p + "hits_total" not in after:
        return None
    d = {
        k: after.get(p + k + "_total", 0.0) - before.get(p + k + "_total", 0.0)
        for k in ("hits", "misses", "copied_bytes", "prefetched", "prefetch_useful", "prefetch_wasted")
    }
    looked = d["hits"] + d["misses"]
    d["hit_rate"] = d["hits"] / looked if looked else None
    judged = d["prefetch_useful"] + d["prefetch_wasted"]
    d["prefetch_accuracy"] = d["prefetch_useful"] / judged if judged else None
    return d


_sent = threading.local()  # when this thread's last HTTP request left the client


def _mark_sent(request) -> None:
    _sent.at = time.perf_counter()


def timed_http_client():
    """An HTTP client of the openai client's kind (httpx, or httpx2 for newer openai releases) that
    marks when each request is sent (None when neither is installed: the openai client's default)."""
    for name in ("httpx", "httpx2"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        return module.Client(event_hooks={"request": [_mark_sent]}, timeout=600)
    return None


def stream(client, model: str, prompt, max_tokens: int, temperature: float) -> dict:
    """One streamed completion (include_usage, ignore_eos): tokens, chunk arrival times, text."""
    _sent.at = None
    t0 = time.perf_counter()
    arrivals, text, usage = [], [], None
    resp = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        temperature=temperature,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in resp:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter() - t0)
            text.append(chunk.choices[0].text)
    tokens = usage.completion_tokens if usage is not None else len(arrivals)
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {
        "tokens": tokens,
        "usage": usage,
        "text": "".join(text),
        "chunks": len(arrivals),
        "ttft_s": arrivals[0] if arrivals else None,
        "ttft_wire_s": t0 + arrivals[0] - _sent.at if arrivals and _sent.at is not None else None,
        "first_s": arrivals[0] if arrivals else None,
        "last_s": arrivals[-1] if arrivals else None,
        "start": t0,
        "tok_s": (tokens - 1) / span if span > 0 else None,
        # the longest wait between two chunks: a stall (a compile, a preemption) shows here, not in a mean
        "max_gap_s": max(gaps) if gaps else None,
        # the typical one: a few slow steps (the host share's guard trying a split) move a short mean, not it
        "median_gap_s": statistics.median(gaps) if gaps else None,
    }


def decode_run(once, n: int, repeats: int) -> dict:
    """`n` concurrent calls of `once` (a streamed completion: `stream`'s dict), `repeats` times back to
    back. Each repeat's per-stream rates, their median and the aggregate (tokens after each stream's
    first over the wall time from the first chunk to the last); the run's `median_stream_tok_s` and
    `aggregate_tok_s` are both the median repeat's (by its median stream; the lower middle one for an
    even count), so one slow repeat (a hiccup of the host, a guard's trial) does not make the figure,
    while `repeats` keeps every one and `median_repeat` says which it was."""
    if repeats < 1:
        raise ValueError(f"--repeats {repeats}: at least 1")
    rounds = []
    for _ in range(repeats):
        with ThreadPoolExecutor(n) as pool:
            runs = list(pool.map(lambda _: once(), range(n)))
        first = min(r["start"] + r["first_s"] for r in runs)
        last = max(r["start"] + r["last_s"] for r in runs)
        tokens = sum(r["tokens"] for r in runs)
        rounds.append(
            {
                "per_stream_tok_s": [r["tok_s"] for r in runs],
                "median_stream_tok_s": statistics.median(r["tok_s"] for r in runs),
                "aggregate_tok_s": (tokens - n) / (last - first),
                "tokens": tokens,
                "max_gap_s": [r["max_gap_s"] for r in runs],
            }
        )
    middle = sorted(range(repeats), key=lambda i: rounds[i]["median_stream_tok_s"])[(repeats - 1) // 2]
    return {
        "streams": n,
        "repeats": rounds,
        "median_repeat": middle,
        "median_stream_tok_s": rounds[middle]["median_stream_tok_s"],
        "aggregate_tok_s": rounds[middle]["aggregate_tok_s"],
        "per_stream_tok_s": [t for r in rounds for t in r["per_stream_tok_s"]],
        "max_gap_s": [g for r in rounds for g in r["max_gap_s"]],
        "tokens": sum(r["tokens"] for r in rounds),
    }


def text_of_tokens(tokenizer_dir: str, n: int, rng, low: int, high: int) -> str | None:
    """Text that the tokenizer of `tokenizer_dir` encodes to exactly `n` tokens, or None when none
    was found: random ids decoded, encoded again (a merge can join two ids' text), cut or topped
    up until it holds. Only ids whose text stands alone are drawn: a byte-level vocabulary's
    tokens that hold part of a UTF-8 character decode to U+FFFD, which encodes to other ids."""
    tok = _tokenizer(tokenizer_dir)
    whole = _whole_ids(tokenizer_dir, low, high)
    if not len(whole):
        return None
    ids = rng.choice(whole, n).tolist()
    for _ in range(16):
        text = tok.decode(ids)
        got = tok.encode(text, add_special_tokens=False).ids
        if len(got) == n:
            return text
        ids = (got + rng.choice(whole, n).tolist())[:n]
    return None


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_dir: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))


@functools.lru_cache(maxsize=4)
def _whole_ids(tokenizer_dir: str, low: int, high: int):
    """The ids in [low, high) whose own text holds no U+FFFD (no part of a UTF-8 character)."""
    import numpy as np

    tok = _tokenizer(tokenizer_dir)
    ids = list(range(low, min(high, tok.get_vocab_size())))
    texts = tok.decode_batch([[i] for i in ids])
    return np.array([i for i, t in zip(ids, texts) if t and "\ufffd" not in t], dtype=np.int64)


def ttft_summary(runs: list[dict], kind: str = "") -> dict:
    """Median TTFT of one-token completions, from the call and from the wire, and the prompt sizes
    the server counted; keys ttft{kind}_s, ... (kind "" for the text prompt, "_ids" for token ids)."""
    wire = [r["ttft_wire_s"] for r in runs if r["ttft_wire_s"] is not None]
    return {
        f"ttft{kind}_s": statistics.median(r["ttft_s"] for r in runs),
        f"ttft{kind}_runs_s": [r["ttft_s"] for r in runs],
        f"ttft{kind}_wire_s": statistics.median(wire) if wire else None,
        f"ttft{kind}_wire_runs_s": wire,
        f"ttft{kind}_prompt_tokens": [r["usage"].prompt_tokens if r["usage"] is not None else None for r in runs],
    }


def hbm_bytes_per_token(config_dir: str, context: float) -> tuple[float, int]:
    """(bytes a single-stream decode step must read from HBM at least, bytes of one expert)."""
    from ferry.plan import pool_layout as L
    from ferry.plan.costs import resident_weight_bytes_from_shapes
    from ferry.plan.dtypes import DTYPE_BYTES
    from ferry.plan.model_config import load_model_config

    spec = load_model_config(config_dir)
    dtype = spec.dtype
    embedding = spec.vocab_size * spec.hidden_size * DTYPE_BYTES[dtype]  # gathered one row, not read
    dense = resident_weight_bytes_from_shapes(spec, dtype) - embedding
    expert = L.expert_bytes(spec, dtype)
    computed = len(spec.moe_layer_indices) * spec.num_experts_per_tok * expert
    kv = context * L.kv_bytes_per_token(spec, dtype)
    linear = 2 * L.linear_state_bytes_per_slot(spec, dtype)
    return dense + computed + kv + linear, expert


def prompt_texts(tokenizer_dir: str, vocab: int | None, seed: int = 0):
    """A function n -> text of exactly n tokens of `tokenizer_dir`'s tokenizer (ids of `id_range`), seeded;
    callable from several threads (the decode runs' streams draw theirs at once)."""
    import numpy as np

    rng, (low, high), lock = np.random.default_rng(seed), id_range(vocab), threading.Lock()

    def draw(n: int) -> str:
        with lock:
            text = text_of_tokens(tokenizer_dir, n, rng, low, high)
        if text is None:
            raise ValueError(f"--prompt-kind text: no text of exactly {n} tokens found with {tokenizer_dir}")
        return text

    return draw


def id_range(vocab: int | None) -> tuple[int, int]:
    """The token ids the prompts draw from: ordinary ones, past the first thousand (specials, bytes) and
    under 100k."""
    high = min(vocab or 10000, 100000)
    return min(1000, high // 2), high


def prompt_ids(vocab: int | None, seed: int = 0):
    """A function n -> n random token ids of `id_range`, seeded."""
    import numpy as np

    rng, (low, high) = np.random.default_rng(seed), id_range(vocab)
    return lambda n: rng.integers(low, high, n).tolist()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--streams", default="1,8")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="each stream count's decode run this many times back to back; the median repeat is reported",
    )
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of the decode runs")
    p.add_argument("--ttft-prompt-len", type=int, default=2000)
    p.add_argument("--ttft-runs", type=int, default=3)
    p.add_argument(
        "--settle-tokens",
        type=int,
        default=0,
        help="one untimed stream of this many tokens before the decode runs: auto's guard over the "
        "host's decode share measures and sizes it over its first ~1,000 decode steps "
        "(services/worker/offload/host_compute/share_guard.py), and the runs then time what it settled on",
    )
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="prompt token ids are drawn below this (default: from --config, else 10000)",
    )
    p.add_argument("--metrics", default=None, help="the worker's Prometheus /metrics URL (Ferry)")
    p.add_argument("--config", default=None, help="the model directory (config.json), for the bound")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="directory with the model's tokenizer.json, for TTFT's text prompt (default: --config)",
    )
    p.add_argument("--ceilings", default=None, help="bench/bandwidth.py JSON measured in the same run, for the bound")
    p.add_argument(
        "--prompt-kind",
        choices=("ids", "text"),
        default="ids",
        help="ids (default): the decode runs send token ids and TTFT is timed as text and as ids; text: "
        "every prompt is text of exactly its length (servers that take no token ids: FreeToken)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1")
    if args.tokenizer and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        p.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
    if args.prompt_kind == "text" and not (Path(args.tokenizer or args.config or "") / "tokenizer.json").is_file():
        p.error(
            "--prompt-kind text needs the model's tokenizer: pass --tokenizer (or --config) DIR with tokenizer.json"
        )

    import numpy as np
    from openai import OpenAI

    client = OpenAI(
        base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=600, http_client=timed_http_client()
    )
    model = args.model or client.models.list().data[0].id
    vocab = args.vocab
    if vocab is None and args.config:
        from ferry.plan.model_config import load_model_config

        vocab = load_model_config(args.config).vocab_size
    prompt, (low, high) = prompt_ids(vocab), id_range(vocab)
    if args.prompt_kind == "text":
        prompt = prompt_texts(args.tokenizer or args.config, vocab)
    result: dict = {
        "base_url": args.base_url,
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "runs": [],
    }

    stream(client, model, prompt(args.prompt_len), 16, args.temperature)  # warm-up
    tokenizer_dir = args.tokenizer or args.config
    texts = None
    if tokenizer_dir and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        text_rng = np.random.default_rng(1)  # its own: the decode runs' prompts do not depend on it
        texts = [
            text_of_tokens(tokenizer_dir, args.ttft_prompt_len, text_rng, low, high) for _ in range(args.ttft_runs)
        ]
        if any(t is None for t in texts):
            print(
                f"warning: no text of exactly {args.ttft_prompt_len} tokens found with {tokenizer_dir}: "
                "TTFT is measured with token ids only",
                file=sys.stderr,
            )
            texts = None
    stream(client, model, prompt(args.ttft_prompt_len), 1, args.temperature)  # the first prompt of this length: untimed
    before = scrape(args.metrics)
    ids_runs, text_runs = [], []
    if args.prompt_kind == "text" and texts is None:
        print(
            f"error: --prompt-kind text: no text of exactly {args.ttft_prompt_len} tokens found with {tokenizer_dir}",
            file=sys.stderr,
        )
        return 2
    for i in range(args.ttft_runs):  # interleaved: neither kind takes all the early runs
        if args.prompt_kind == "ids":
            ids_runs.append(stream(client, model, prompt(args.ttft_prompt_len), 1, args.temperature))
        if texts:
            text_runs.append(stream(client, model, texts[i], 1, args.temperature))
    result["ttft_expert_cache"] = cache_delta(before, scrape(args.metrics))  # what the prefills copied
    result["ttft_prefills"] = len(ids_runs) + len(text_runs)
    result.update(
        ttft_summary(ids_runs, "_ids")
        if ids_runs
        else {f"ttft_ids{k}": None for k in ("_s", "_runs_s", "_wire_s", "_wire_runs_s", "_prompt_tokens")}
    )
    result.update(ttft_summary(text_runs or ids_runs))  # ttft_s: the text prompt's, else the ids'
    result["ttft_prompt"] = "text" if text_runs else "ids"
    as_ids = (
        f"; as token ids {1e3 * result['ttft_ids_s']:.0f} ms, "
        f"{1e3 * (result['ttft_ids_wire_s'] or float('nan')):.0f} ms from the wire"
        if ids_runs
        else ""
    )
    print(
        f"TTFT ({args.ttft_prompt_len}-token prompt): median {1e3 * result['ttft_s']:.0f} ms of {args.ttft_runs} "
        f"({result['ttft_prompt']}; server counted {result['ttft_prompt_tokens']} tokens){as_ids}"
    )

    if args.settle_tokens:
        settled = stream(client, model, prompt(args.prompt_len), args.settle_tokens, args.temperature)
        result["settle"] = {"tokens": settled["tokens"], "tok_s": settled["tok_s"]}
    ceilings = json.loads(Path(args.ceilings).read_text()) if args.ceilings else None
    for n in [int(s) for s in args.streams.split(",")]:
        before = scrape(args.metrics)
        run = decode_run(
            lambda: stream(client, model, prompt(args.prompt_len), args.max_tokens, args.temperature), n, args.repeats
        )
        tokens = run["tokens"]
        run["expert_cache"] = cache = cache_delta(before, scrape(args.metrics))  # over every repeat
        if cache is not None:
            run["copied_bytes_per_token"] = cache["copied_bytes"] / tokens
        if cache is not None and ceilings and args.config and n == 1:
            hbm, expert = hbm_bytes_per_token(args.config, args.prompt_len + args.max_tokens / 2)
            copies = cache["misses"] + cache["prefetched"]
            wire = cache["copied_bytes"] / copies if copies else expert  # per expert, as it crossed
            crossing = (cache["misses"] + cache["prefetch_useful"]) / tokens  # experts a token had to bring
            h2d, hbm_bw = ceilings["h2d_pinned_GBps"] * 1e9, ceilings["hbm_copy_GBps"] * 1e9
            bound_s = crossing * wire / h2d + hbm / hbm_bw
            bf16_s = crossing * expert / h2d + hbm / hbm_bw
            run.update(
                bound_tok_s=1 / bound_s,
                bound_fraction=run["median_stream_tok_s"] * bound_s,
                bound_bf16_tok_s=1 / bf16_s,
                bound_bf16_fraction=run["median_stream_tok_s"] * bf16_s,
                needed_bytes_per_token=crossing * wire,
                wire_bytes_per_expert=wire,
                hbm_bytes_per_token=hbm,
            )
        result["runs"].append(run)
        hit = f"hit rate {cache['hit_rate']:.3f}" if cache and cache["hit_rate"] is not None else ""
        pre = (
            f"prefetch accuracy {cache['prefetch_accuracy']:.3f}"
            if cache and cache["prefetch_accuracy"] is not None
            else ""
        )
        bound = (
            f"bound {run['bound_tok_s']:.1f} tok/s ({run['bound_fraction']:.2f} of it)" if "bound_tok_s" in run else ""
        )
        gap = max((g for g in run["max_gap_s"] if g is not None), default=0.0)
        spread = ", ".join(f"{r['median_stream_tok_s']:.1f}" for r in run["repeats"])
        print(
            f"{n} streams: median {run['median_stream_tok_s']:.1f} tok/s per stream (repeats {spread}), aggregate "
            f"{run['aggregate_tok_s']:.1f} tok/s, longest gap {1e3 * gap:.0f} ms  {hit}  {pre}  {bound}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
