"""One long prompt's time to first token against its bounds (issue 24: the full-size Qwen3.6-35B-A3B at
24 GiB with a 261,988-token prompt), and decode before and after it, through the openai client.

The client sends an untimed warm-up, a short prompt (the decode rate with an empty context), then the
long one as token ids, streaming with `ignore_eos`. TTFT is the first chunk's arrival; prefill tokens/s is
the prompt over TTFT; the decode after it is the long request's own continuation (every token attends to
the whole prompt), 144 tokens by default (the 35B's context leaves the issue's prompt 156), each rate
given as the mean over them and as the median step (`_median_tok_s`: a few slow steps, such as the host
share's guard trying a split, move the mean of so few tokens but not the median). One run of 144 tokens
still varies by several per cent from server to server, so `--decode-repeats N` (3) sends the long prompt
N - 1 more times, prefilled from the prefix cache (each repeat's TTFT and cached tokens are reported), and the
short one N times: `decode_after_repeats_median_tok_s` is the median of the N runs' median-step rates, the
figure to compare between two servers (issue 24: the plan's 16k chunk against 8k). The bounds beside
them, for the plan the worker booted with (its boot log's `plan` line: the prefill chunk and the expert
slots):

    compute: 2 FLOP a weight a prompt token (the dense layers, the k routed experts) + causal attention
             (QK^T and PV over the triangle: 2 x 2 x L(L+1)/2 x heads x head_dim, each full-attention layer),
             over the bf16 matmul rate measured on the device in the same run;
    PCIe:    each chunk streams every routed expert without a slot once (a chunk of thousands of tokens
             routes to nearly all of them): ceil(L / chunk) x unslotted x bytes an expert, over pinned H2D;
             and, measured, the expert bytes the worker copied during the long request (its prefill and its
             `--max-tokens` decode steps, whose few copies are small beside the prefill's) over the same bandwidth.

`bound_s` is the larger of compute and PCIe (they overlap: the next layer's experts stream while this
layer computes). Attention at FlashAttention-class throughput runs at 0.5-0.7 of the matmul rate, so a
TTFT within ~1.5x of the bound is what the kernels allow.

    python3 bench/long_context.py --base-url http://127.0.0.1:8000/v1 --config DIR --serve-log serve.log \\
        --ceilings ceilings.json --prompt-len 261988 --out long_context_36b.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_openai import cache_delta, prompt_ids, scrape, stream, timed_http_client  # noqa: E402

LONG_PROMPT = 261_988  # the prompt: the 35B's 262,144-token context less a completion's room


def prefill_flops(spec, prompt_len: int, dtype: str = "bfloat16") -> dict:
    """The matmul FLOPs of prefilling `prompt_len` tokens: the weights each token multiplies (every resident
    weight but the embeddings and lm_head, which a prefill reads once for its last row; the k routed experts)
    and causal attention in the full-attention layers."""
    from ferry.plan.costs import resident_weight_bytes_from_shapes
    from ferry.plan.dtypes import DTYPE_BYTES

    h, v = spec.hidden_size, spec.vocab_size
    resident_params = resident_weight_bytes_from_shapes(spec, dtype) / DTYPE_BYTES[dtype]
    per_token = resident_params - v * h * (1 if spec.tie_word_embeddings else 2)
    per_token += len(spec.moe_layer_indices) * spec.num_experts_per_tok * 3 * spec.moe_intermediate_size * h
    linear = 2 * prompt_len * per_token
    pairs = prompt_len * (prompt_len + 1) / 2  # (query, key) pairs of the causal triangle
    attention = 4 * pairs * spec.num_attention_heads * spec.head_dim * len(spec.full_attention_layers)
    return {"linear_flops": linear, "attention_flops": attention, "flops": linear + attention}


def streamed_bytes(total_experts: int, slots: int, expert_bytes: int, prompt_len: int, chunk: int) -> int:
    """Expert bytes a chunked prefill streams: each chunk every expert without a slot, once."""
    return math.ceil(prompt_len / chunk) * max(0, total_experts - slots) * expert_bytes


def crossing_bytes(plan: dict, spec, dtype: str) -> int:
    """The bytes one expert moves over PCIe: its host bank's share (packed banks: 12 bits a value and the
    escapes; a quantized checkpoint's experts as the slots hold them), or its slot bytes when none are banked."""
    from ferry.plan.pool_layout import expert_bytes

    if plan.get("host_expert_bank_bytes"):
        return plan["host_expert_bank_bytes"] // plan["expert_total"]
    return expert_bytes(spec, dtype)


def bounds(flops: dict, pcie_bytes: int, h2d_GBps: float, tflops: float | None) -> dict:
    compute_s = flops["flops"] / (tflops * 1e12) if tflops else None
    pcie_s = pcie_bytes / (h2d_GBps * 1e9)
    return {
        "compute_s": compute_s,
        "pcie_s": pcie_s,
        "bound_s": max(pcie_s, compute_s or 0.0),
        "attention_compute_s": flops["attention_flops"] / (tflops * 1e12) if tflops else None,
    }


def booted_plan(serve_log: Path) -> dict:
    """The worker's `plan` log line (JSON lines): its prefill chunk, expert slots and the rest, with the host
    banks' bytes from its `expert_host_banks` line (absent where every expert has a slot)."""
    plan, banks = None, None
    for line in serve_log.read_text().splitlines():
        for event in ("plan", "expert_host_banks"):
            if f'"event": "{event}"' in line:
                try:
                    fields = json.loads(line[line.index("{") :])
                except ValueError:
                    continue
                if event == "plan":
                    plan = plan or fields
                else:
                    banks = banks or fields["bytes"]
    if plan is None:
        raise ValueError(f"{serve_log}: no plan line: is it the log of `ferry serve`?")
    return {**plan, "host_expert_bank_bytes": banks or 0}


def _median_tok_s(run: dict) -> float | None:
    """A streamed run's decode rate from its median wait between chunks (a chunk is a token but where the
    server sent several at once: the mean tokens a chunk, over that wait)."""
    if not run["median_gap_s"] or run["chunks"] < 2:
        return None
    return (run["tokens"] - 1) / (run["chunks"] - 1) / run["median_gap_s"]


def _decode_run(run: dict) -> dict:
    """What one streamed request's decode gave: its TTFT, the prompt tokens the prefix cache served, both rates."""
    details = getattr(run["usage"], "prompt_tokens_details", None) if run["usage"] else None
    return {
        "ttft_s": run["ttft_s"],
        "ttft_wire_s": run["ttft_wire_s"],
        "cached_tokens": getattr(details, "cached_tokens", None),
        "tok_s": run["tok_s"],
        "median_tok_s": _median_tok_s(run),
    }


def _median_of_runs(runs: list[dict]) -> float | None:
    rates = [r["median_tok_s"] for r in runs if r["median_tok_s"] is not None]
    return statistics.median(rates) if rates else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--config", required=True, help="the served model directory (config.json)")
    p.add_argument("--serve-log", required=True, type=Path, help="ferry serve's log, for the booted plan")
    p.add_argument(
        "--ceilings",
        required=True,
        help="bench/bandwidth.py JSON of the same run (h2d_pinned_GBps, bf16_matmul_TFLOPs)",
    )
    p.add_argument("--metrics", default=None, help="the worker's /metrics URL (the expert bytes copied)")
    p.add_argument("--prompt-len", type=int, default=LONG_PROMPT)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=144,
        help="decoded after each prompt (the 35B's 262,144 positions leave the issue's prompt 156)",
    )
    p.add_argument(
        "--decode-repeats",
        type=int,
        default=3,
        help="decode runs after the long prompt (the first its "
        "own continuation, the rest the same prompt again from the prefix cache) and with the short one",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from openai import OpenAI

    from ferry.plan.model_config import load_model_config

    spec = load_model_config(args.config)
    plan = booted_plan(args.serve_log)
    ceilings = json.loads(Path(args.ceilings).read_text())
    # the timed HTTP client marks when a request leaves: a 262k-id request takes the openai client seconds to
    # build (serve_openai.py measured 20-40 ms for 2,000 ids), which ttft_s counts and ttft_wire_s does not
    client = OpenAI(
        base_url=args.base_url, api_key="none", max_retries=0, timeout=3600, http_client=timed_http_client()
    )
    model = client.models.list().data[0].id
    ids = prompt_ids(spec.vocab_size)
    stream(client, model, ids(args.short_len), 4, 1.0)  # warm-up: first-use costs out of the short rate
    short = stream(client, model, ids(args.short_len), args.max_tokens, 1.0)
    before = scrape(args.metrics)
    long_prompt = ids(args.prompt_len)
    long = stream(client, model, long_prompt, args.max_tokens, 1.0)
    copied = cache_delta(before, scrape(args.metrics))
    # after the copies are counted: the repeats' decode copies would add to the long prefill's
    after_runs = [_decode_run(long)]
    while len(after_runs) < args.decode_repeats:
        after_runs.append(_decode_run(stream(client, model, long_prompt, args.max_tokens, 1.0)))
        if (after_runs[-1]["cached_tokens"] or 0) < args.prompt_len // 2:
            break  # prefilled again, not from the cache: a repeat would cost a whole prefill (reported as it came)
    short_runs = [_decode_run(short)] + [
        _decode_run(stream(client, model, ids(args.short_len), args.max_tokens, 1.0))
        for _ in range(args.decode_repeats - 1)
    ]
    flops = prefill_flops(spec, args.prompt_len, spec.dtype)  # the plan line names no dtype: the checkpoint's
    modelled = streamed_bytes(
        plan["expert_total"],
        plan["expert_slots"],
        crossing_bytes(plan, spec, spec.dtype),
        args.prompt_len,
        plan["max_prefill_tokens"],
    )
    b = bounds(flops, modelled, ceilings["h2d_pinned_GBps"], ceilings.get("bf16_matmul_TFLOPs"))
    result = {
        "prompt_tokens": long["usage"].prompt_tokens if long["usage"] else args.prompt_len,
        "ttft_s": long["ttft_s"],
        "ttft_wire_s": long["ttft_wire_s"],
        "prefill_tok_s": args.prompt_len / long["ttft_s"],
        "decode_after_tok_s": long["tok_s"],
        "decode_short_tok_s": short["tok_s"],
        "max_gap_after_s": long["max_gap_s"],
        "decode_after_median_tok_s": _median_tok_s(long),
        "decode_short_median_tok_s": _median_tok_s(short),
        "decode_tokens": long["tokens"],
        "decode_after_repeats_median_tok_s": _median_of_runs(after_runs),
        "decode_short_repeats_median_tok_s": _median_of_runs(short_runs),
        "decode_after_runs": after_runs,
        "decode_short_runs": short_runs,
        # no bound where nothing streams and no matmul rate was measured (bench/bandwidth.py's command line)
        **b,
        "ttft_over_bound": long["ttft_s"] / b["bound_s"] if b["bound_s"] else None,
        "streamed_bytes_model": modelled,
        "copied_bytes": copied["copied_bytes"] if copied else None,
        "copied_pcie_s": copied["copied_bytes"] / (ceilings["h2d_pinned_GBps"] * 1e9) if copied else None,
        **flops,
        "max_prefill_tokens": plan["max_prefill_tokens"],
        "expert_slots": plan["expert_slots"],
        "expert_total": plan["expert_total"],
        "ceilings": ceilings,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
