"""Do a streamed prefill's expert copies overlap its attention? One long-context attention chunk (SDPA's
FlashAttention, as kernels/paged_attention_flash.py calls it) on the compute stream, and one MoE layer's
missed experts copied the way the staging ring copies them (services/worker/offload/host_memory/staging_ring.py:
chunks of 12 experts, packed banks through the unpacking kernel, plain ones through the copy engine) on a
second stream, first each alone, then both at once. For each copy variant (bank format, unpacking programs,
the copy stream's priority) it prints the three times and the overlap: the share of the shorter of the two
that the concurrent run hid, (attention + copies - both) / min(attention, copies); 1 is full overlap, 0 none.

The 262k-token prompt of bench/NOTES.md ("FlashAttention for long prefills, lent cache slots") added its
copies to its compute; this says whether the unpacking kernel's need for SMs is why, and what plain banks
(no SM at all) or fewer programs give.

    python3 bench/ring_overlap.py --config tests/data/models/qwen3.6-35b-a3b/config.json --context 131072 \\
        --experts 224 --out ring_overlap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.copy_paths import timed  # noqa: E402
from ferry.plan.model_config import load_model_config  # noqa: E402
from ferry.services.worker.offload.host_memory.host_banks import HostBanks  # noqa: E402
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks  # noqa: E402

RING_CHUNK = 12  # experts a ring chunk copies at once (48 staging slots in four bays)
# (bank format, unpacking programs or None for the copy engine, copy stream priority)
VARIANTS = [
    ("packed", 64, 0),
    ("packed", 64, -100),
    ("packed", 32, -100),
    ("packed", 16, -100),
    ("plain", None, 0),
    ("plain", None, -100),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tests/data/models/qwen3.6-35b-a3b/config.json")
    p.add_argument("--context", type=int, default=131072, help="keys before the chunk")
    p.add_argument("--chunk", type=int, default=8192, help="the chunk's new tokens")
    p.add_argument("--experts", type=int, default=224, help="experts copied (one layer's missing ones at 24 GiB)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    spec = load_model_config(Path(args.config).parent)  # before the device: a wrong path fails here, on CPU too
    if not torch.cuda.is_available():
        raise SystemExit("ring_overlap.py needs a CUDA device")
    device = torch.device("cuda")
    attend = _attention(spec, args.chunk, args.context, device)
    shape = (1, spec.num_experts, spec.hidden_size, spec.moe_intermediate_size, torch.bfloat16)
    banks = {}
    for name, kind in (("packed", PackedHostBanks), ("plain", HostBanks)):
        banks[name] = kind.allocate(*shape, pin=True, progress=False)
        banks[name].fill_dummy(seed=1, progress=False)
    n = min(args.experts, spec.num_experts)
    w13 = torch.empty((n, *banks["plain"].w13[0].shape[1:]), dtype=torch.bfloat16, device=device)
    w2 = torch.empty((n, *banks["plain"].w2[0].shape[1:]), dtype=torch.bfloat16, device=device)
    attention_ms = statistics.median(timed(attend, args.reps))
    results = {
        "device": torch.cuda.get_device_name(device),
        "context": args.context,
        "chunk": args.chunk,
        "experts": n,
        "attention_ms": round(attention_ms, 3),
        "runs": [],
    }
    print(f"attention alone: {attention_ms:.2f} ms ({args.chunk} queries after {args.context} keys)")
    for fmt, programs, priority in VARIANTS:
        stream = torch.cuda.Stream(device, priority=priority)
        tuning = {} if programs is None else {"programs": programs}

        def run(with_attention: bool, bank=banks[fmt], stream=stream, tuning=tuning) -> None:
            """The layer's copies on `stream` in ring chunks, the attention on the current stream beside them."""
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for first in range(0, n, RING_CHUNK):
                    pairs = [(e, e) for e in range(first, min(n, first + RING_CHUNK))]
                    bank.copy_experts(0, pairs, w13, w2, non_blocking=True, **tuning)
            if with_attention:
                attend()
            torch.cuda.current_stream().wait_stream(stream)

        copy_ms = statistics.median(timed(lambda: run(False), args.reps))
        both_ms = statistics.median(timed(lambda: run(True), args.reps))
        overlap = (attention_ms + copy_ms - both_ms) / min(attention_ms, copy_ms)
        gbps = n * banks[fmt].expert_nbytes / copy_ms / 1e6
        row = {
            "format": fmt,
            "programs": programs,
            "priority": priority,
            "copies_ms": round(copy_ms, 3),
            "copies_GBps": round(gbps, 1),
            "both_ms": round(both_ms, 3),
            "overlap": round(overlap, 3),
        }
        results["runs"].append(row)
        print(
            f"{fmt:6s} programs {str(programs):4s} priority {priority:4d}: "
            f"copies {copy_ms:7.2f} ms ({gbps:5.1f} GB/s), "
            f"both {both_ms:7.2f} ms, overlap {overlap:.2f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def _attention(spec, chunk: int, context: int, device):
    """One full-attention layer's FlashAttention over a chunk after `context` keys, the served shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    heads, kv_heads, hd = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    total = context + chunk
    q = torch.randn(1, chunk, heads, hd, dtype=torch.bfloat16, device=device).transpose(1, 2)
    k = torch.randn(1, total, kv_heads, hd, dtype=torch.bfloat16, device=device).transpose(1, 2)
    v = torch.randn_like(k)
    mask = causal_lower_right(chunk, total)

    def attend() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return attend


if __name__ == "__main__":
    sys.exit(main())
