"""The activation workspace of a prefill step by its tokens and its token mixers' slice (issue 24).

A step longer than `MIXER_SLICE_TOKENS` runs each layer's token mixer over slices of that many tokens and its
MoE block over all of them (services/worker/mixer_slices.py). On a small card the workspace's bytes are
expert slots, so what a step of N tokens costs with slices of S decides both the chunk a long prompt
should take (fewer passes over the experts without a slot) and the slice (a mixer phase smaller than the
MoE phase frees nothing more). This measures it as boot does (`profile_workspace_cuda`: the largest step
on temporary pools, peak reserved over the baseline, plus the long-context gather), on the model's real
shapes with dummy dense weights, for each (--tokens, --slices) pair, and prints the slots each costs at the
model's bytes an expert slot (bf16-packed banks keep bf16 slots).

    python3 bench/workspace_slices.py --model tests/data/models/qwen3.6-35b-a3b --max-model-len 262144 \\
        --tokens 8192,16384 --slices 8192,4096,2048 --out bench/results/workspace_slices_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferry.plan.costs import workspace_bytes_estimate  # noqa: E402
from ferry.plan.model_config import load_model_config  # noqa: E402
from ferry.plan.planner import PlanRequest, resolve  # noqa: E402
from ferry.plan.pool_layout import expert_weight_tensors  # noqa: E402
from ferry.services.worker import forward_batch  # noqa: E402
from ferry.services.worker.dummy_weights import iter_dummy_tensors  # noqa: E402
from ferry.services.worker.late_bound_experts import LateBoundExperts  # noqa: E402
from ferry.services.worker.models import build_model  # noqa: E402
from ferry.services.worker.pools import TORCH_DTYPES  # noqa: E402
from ferry.services.worker.workspace_profile import profile_workspace_cuda  # noqa: E402


def slot_bytes(spec, dtype: str) -> int:
    """Bytes of one GPU expert slot (bf16-packed host banks keep bf16 slots)."""
    return sum(t.nbytes for t in expert_weight_tensors(spec, dtype, 1))


def measure(
    model,
    experts,
    spec,
    r,
    tokens: list[int],
    slices: list[int],
    profile=profile_workspace_cuda,
    device: torch.device | None = None,
) -> list[dict]:
    """One row for each step of `tokens` and each of `slices` below it (a slice of the step's tokens or more
    leaves it whole: measured once), `profile` measuring each as boot does; MIXER_SLICE_TOKENS is put back."""
    per_slot = slot_bytes(spec, r.dtype)
    kept, rows = forward_batch.MIXER_SLICE_TOKENS, []
    try:
        for step_tokens in tokens:
            for slice_tokens in sorted({min(s, step_tokens) for s in slices}, reverse=True):
                forward_batch.MIXER_SLICE_TOKENS = slice_tokens
                t0 = time.perf_counter()
                workspace = profile(
                    model, experts, spec, dataclasses.replace(r, max_prefill_tokens=step_tokens), device
                )
                rows.append(
                    {
                        "tokens": step_tokens,
                        "slice_tokens": slice_tokens,
                        "workspace_bytes": workspace,
                        "slots": round(workspace / per_slot, 1),
                        "seconds": round(time.perf_counter() - t0, 2),
                        "estimate_bytes": workspace_bytes_estimate(
                            spec, r.dtype, step_tokens, r.max_running_requests, r.max_model_len, slice_tokens
                        ),
                    }
                )
                print(
                    f"{step_tokens:6d} tokens, mixers in slices of {slice_tokens:5d}: workspace "
                    f"{workspace / 2**30:6.2f} GiB = {rows[-1]['slots']:7.1f} expert slots ({rows[-1]['seconds']} s)",
                    flush=True,
                )
    finally:
        forward_batch.MIXER_SLICE_TOKENS = kept
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tests/data/models/qwen3.6-35b-a3b", help="a model directory (its config.json)")
    p.add_argument("--tokens", default="8192,16384", help="the step's new tokens (--max-prefill-tokens)")
    p.add_argument("--slices", default="8192,4096,2048", help="the mixers' slice (MIXER_SLICE_TOKENS)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: 262,144 or the model's max_position_embeddings, whichever is fewer",
    )
    p.add_argument("--max-running-requests", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = load_model_config(args.model)  # before the device: a wrong path fails here, on CPU too
    max_model_len = args.max_model_len or min(262144, spec.max_position_embeddings)
    r = resolve(spec, PlanRequest(max_running_requests=args.max_running_requests, max_model_len=max_model_len))
    if not torch.cuda.is_available():
        p.error("needs CUDA: on CPU the worker estimates the workspace (plan/costs.py), it does not measure it")
    device = torch.device("cuda")
    dtype = TORCH_DTYPES[r.dtype]
    experts = LateBoundExperts(spec.num_experts)
    model = build_model(spec, dtype, device, experts)
    model.load_weights(iter_dummy_tensors(spec, dtype, device, routed_experts=False), routed_experts=False)
    rows = measure(
        model,
        experts,
        spec,
        r,
        [int(t) for t in args.tokens.split(",")],
        [int(s) for s in args.slices.split(",")],
        device=device,
    )
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name(device),
        "dtype": r.dtype,
        "max_model_len": r.max_model_len,
        "max_running_requests": r.max_running_requests,
        "expert_slot_bytes": slot_bytes(spec, r.dtype),
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
