"""A streamed layer's expert GEMMs, chunk by chunk as the staging ring hands them over, launched over every
block of the layer (each program checks its block's slot and most exit at once) against launched over the
chunk's own blocks (`align_pairs_by_slot(..., block_starts=True)`: a few programs loop over the window's
blocks, read on the device). services/worker/offload/stores/device_driven.py's `_stream_staged` makes these calls;
bench/NOTES.md ("Where a long prompt's chunk goes") measured ~77 us a launch for ~12.9 GFLOP at 8,192
tokens, two launches a ring chunk, 876 chunks a 35B prefill chunk.

For each case (tokens in the step, staged experts of the layer's 256, bank format) it prints the layer's
time both ways (CUDA events around all its chunks' launches, median of --reps after a warm-up), the
GEMMs' FLOPs over it, and the ratio; --out writes them as JSON.

    python3 bench/expert_window.py --out expert_window.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferry.kernels.align_pairs import align_pairs_by_slot  # noqa: E402
from ferry.kernels.aligned_blocks import block_m_for  # noqa: E402
from ferry.kernels.grouped_expert_gemm import grouped_expert_rows_triton  # noqa: E402
from ferry.plan.model_config import load_model_config  # noqa: E402

RING_CHUNK = 12  # experts a ring chunk holds (48 staging slots in four bays)
# (tokens in the step, staged experts): a 35B prefill chunk far into a long prompt, and issue 23's warm
# step of 8 rows (1,250 tokens) on the 8-layer cut with 640 slots (176 of 256 experts a layer missing)
CASES = [(8192, 230), (1250, 176)]


def layer_seconds(x, weights, w13, w2, rows, aligned, staged: int, reps: int) -> float:
    """Median seconds of one layer's chunks, each a slot_window over RING_CHUNK positions."""

    def once():
        for lo in range(0, staged, RING_CHUNK):
            hi = min(lo + RING_CHUNK, staged)
            grouped_expert_rows_triton(x, None, weights, w13, w2, rows, aligned=aligned, slot_window=(lo, hi, -lo))

    once()  # compile
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def run_case(spec, tokens: int, staged: int, fmt: str, reps: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    hidden, inter, experts, top_k = (
        spec.hidden_size,
        spec.moe_intermediate_size,
        spec.num_experts,
        spec.num_experts_per_tok,
    )
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k, dim=-1).indices
    position = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
    position[torch.randperm(experts, device="cuda", generator=g)[:staged]] = torch.arange(
        staged, dtype=torch.int32, device="cuda"
    )
    pos = position[ids]
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=g), dim=-1).float()
    if fmt == "bf16":
        w13 = (torch.randn(RING_CHUNK, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(RING_CHUNK, hidden, inter, device="cuda", generator=g) * inter**-0.5).to(torch.bfloat16)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit" / "kernels"))
        from quantized_slots import make_experts

        w13, w2 = make_experts(fmt, hidden, inter, RING_CHUNK, torch.Generator().manual_seed(tokens), device="cuda")
    rows = torch.zeros(tokens, top_k, hidden, device="cuda")
    aligned = align_pairs_by_slot(pos, staged, block_m_for(pos.numel()), staged, block_starts=True)
    full = layer_seconds(x, weights, w13, w2, rows, aligned[:2], staged, reps)
    windowed = layer_seconds(x, weights, w13, w2, rows, aligned, staged, reps)
    flops = 2 * int((pos >= 0).sum()) * 3 * hidden * inter
    chunks = -(-staged // RING_CHUNK)
    return {
        "tokens": tokens,
        "staged": staged,
        "format": fmt,
        "chunks": chunks,
        "gflop": round(flops / 1e9, 2),
        "full_grid_ms": round(full * 1e3, 3),
        "windowed_ms": round(windowed * 1e3, 3),
        "full_grid_tflops": round(flops / full / 1e12, 1),
        "windowed_tflops": round(flops / windowed / 1e12, 1),
        "full_over_windowed": round(full / windowed, 3),
        "per_chunk_us": {"full_grid": round(full / chunks * 1e6, 1), "windowed": round(windowed / chunks * 1e6, 1)},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tests/data/models/qwen3.6-35b-a3b", help="a model directory (its config.json)")
    p.add_argument("--formats", default="bf16,nvfp4,fp8-block")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = load_model_config(args.config)  # before the device: a wrong path fails here, on CPU too
    if not torch.cuda.is_available():
        raise SystemExit("expert_window.py needs a CUDA device")
    results = []
    for fmt in args.formats.split(","):
        for tokens, staged in CASES:
            r = run_case(spec, tokens, staged, fmt, args.reps)
            results.append(r)
            print(
                f"{fmt:9s} {tokens:5d} tokens, {staged} staged ({r['chunks']} chunks, {r['gflop']} GFLOP): "
                f"full grid {r['full_grid_ms']} ms ({r['full_grid_tflops']} TFLOPS), windowed {r['windowed_ms']} ms "
                f"({r['windowed_tflops']} TFLOPS), {r['full_over_windowed']}x",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
