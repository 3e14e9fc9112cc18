"""The long prefill's attention on the device (issue 24): Ferry's paged prefill kernel against torch's
scaled_dot_product_attention (FlashAttention / memory-efficient backends) on the same shapes.

One request's prefill chunk of `--chunk` new tokens after `--context` tokens already in the cache, the
keys read through a page table of shuffled 16-token pages (as the worker's pool holds them); SDPA gets the
same keys contiguous, its causal mask aligned to the bottom right (`causal_lower_right`: row i sees keys
0..context + i). For each (context, backend): the median of `--repeats` CUDA-event timings after warm-up,
the causal FLOPs (2 x 2 x head_dim x heads per (query, visible key)) over it, and for each SDPA backend the
largest difference between its output and the kernel's (both bf16: the kernel's correctness at that length).
`--tiles rows,keys,warps;...` times other prefill tiles too (`prefill_tiles` picks the default).

    python3 bench/prefill_attention.py --heads 16 --kv-heads 2 --head-dim 256 --contexts 0,65536,253952 \
        --out bench/results/prefill_attention_h200.json

The 261,988-token prompt of the long-context workload is 32 chunks of 8192 over contexts 0..253,952: the
sum over those chunks of the kernel's time, times the model's 10 full-attention layers, is the attention's
share of its TTFT (`--whole-prompt` times all 32 chunks and writes that sum)."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bandwidth import _time_ms  # noqa: E402
from bench.decode_suite import commit  # noqa: E402
from ferry.kernels.paged_attention_triton import paged_attention_prefill_triton, prefill_tiles  # noqa: E402

PAGE = 16


def causal_flops(chunk: int, context: int, heads: int, head_dim: int) -> float:
    """QK^T and PV over the keys each new token sees (context + its own position + 1)."""
    visible = chunk * context + chunk * (chunk + 1) / 2
    return 4.0 * head_dim * heads * visible


def scenario(chunk: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype, seed: int = 0):
    """(paged inputs of the kernel, contiguous q/k/v of SDPA) for one request."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = context + chunk
    pages = -(-total // PAGE)
    k = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    q = torch.randn(chunk, heads, head_dim, device="cuda", dtype=dtype, generator=g)
    order = list(range(1, pages + 1))
    random.Random(seed).shuffle(order)
    page_table = torch.tensor([order], dtype=torch.int32, device="cuda")
    k_cache = torch.zeros(pages + 1, PAGE, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(total, device="cuda")
    k_cache[page_table[0, pos // PAGE].long(), pos % PAGE] = k
    v_cache[page_table[0, pos // PAGE].long(), pos % PAGE] = v
    query_start = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    positions = torch.arange(context, total, device="cuda")
    paged = (q, k_cache, v_cache, page_table, query_start, positions, [chunk], head_dim**-0.5)
    # SDPA's layout: [batch, heads, tokens, head_dim]
    dense = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    return paged, dense


def sdpa(dense, backend, chunk: int, total: int):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = dense
    mask = causal_lower_right(chunk, total)
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--contexts", default="0,65536,131072,253952")
    p.add_argument("--tiles", default="", help="more prefill tiles to time: rows,keys,warps;rows,keys,warps")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--whole-prompt", type=int, default=0, help="also time every chunk of a prompt this long")
    p.add_argument("--out")
    args = p.parse_args()
    from torch.nn.attention import SDPBackend

    dtype = torch.bfloat16
    heads, kv, hd, chunk = args.heads, args.kv_heads, args.head_dim, args.chunk
    default = prefill_tiles(hd, heads // kv)
    tiles = [default] + [tuple(int(x) for x in t.split(",")) for t in args.tiles.split(";") if t]
    rows_out = []
    for context in (int(c) for c in args.contexts.split(",")):
        paged, dense = scenario(chunk, context, heads, kv, hd, dtype)
        flops = causal_flops(chunk, context, heads, hd)
        row = {"context": context, "chunk": chunk, "tflop": flops / 1e12}
        for rows, keys, warps in tiles:
            name = f"ferry[{rows}x{keys},w{warps}]"

            def run(rows=rows, keys=keys, warps=warps):
                return paged_attention_prefill_triton(*paged, block_rows=rows, block_n=keys, num_warps=warps)

            ms = _time_ms(run, args.repeats)
            row[name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
        out_ferry = paged_attention_prefill_triton(*paged)
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                ms = _time_ms(lambda b=backend: sdpa(dense, b, chunk, context + chunk), args.repeats)
                ref = sdpa(dense, backend, chunk, context + chunk)[0].transpose(0, 1)
                row[f"sdpa[{backend.name}]"] = {
                    "ms": round(ms, 3),
                    "tflops": round(flops / ms / 1e9, 1),
                    "max_abs_diff_vs_ferry": float((ref.float() - out_ferry.float()).abs().max()),
                }
            except RuntimeError as exc:  # a backend that cannot take these shapes says why
                row[f"sdpa[{backend.name}]"] = {"error": str(exc).splitlines()[0][:300]}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        paged = dense = None  # frees them (the timed lambdas read them)
        torch.cuda.empty_cache()
    result = {
        "commit": commit(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "heads": heads,
        "kv_heads": kv,
        "head_dim": hd,
        "default_tiles": default,
        "runs": rows_out,
    }
    if args.whole_prompt:
        total_ms = 0.0
        for context in range(0, args.whole_prompt, chunk):
            n = min(chunk, args.whole_prompt - context)
            paged, _ = scenario(n, context, heads, kv, hd, dtype)
            total_ms += _time_ms(lambda paged=paged: paged_attention_prefill_triton(*paged), 1)
            del paged
            torch.cuda.empty_cache()
        result["whole_prompt"] = {"tokens": args.whole_prompt, "one_layer_s": round(total_ms / 1e3, 3)}
        print(json.dumps(result["whole_prompt"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
