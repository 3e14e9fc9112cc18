"""The planner's command-line flags, shared by `ferry plan`, `ferry worker`, `ferry serve` and `ferry generate`."""

from __future__ import annotations

import argparse

from ferry.shared.units import parse_bytes
from ferry.plan.planner import PlanRequest

PLANNER_FIELDS = (
    "gpu_memory", "memory_ratio", "num_tokens", "num_pages", "kv_reserve_tokens", "moe_cache_size",
    "moe_cache_rate", "page_size", "max_running_requests", "max_prefill_tokens", "max_model_len", "dtype",
)  # fmt: skip


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_planner_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory plan")
    g.add_argument("--gpu-memory", type=_byte_size, default=None,
                   help="device memory the worker may use, e.g. 24GiB (default: the GPU's free memory); never exceeded")
    g.add_argument("--memory-ratio", type=float, default=None,
                   help="fraction of --gpu-memory handed to the planner (default 0.9)")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-tokens", type=int, default=None, help="KV pool size in tokens (exact requirement)")
    kv.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages (exact requirement)")
    g.add_argument("--kv-reserve-tokens", type=int, default=None,
                   help="lower bound on KV tokens; automatic sizing may give more (default: --max-model-len)")
    moe = g.add_mutually_exclusive_group()
    moe.add_argument("--moe-cache-size", type=int, default=None, help="GPU expert slots (exact requirement)")
    moe.add_argument("--moe-cache-rate", type=float, default=None,
                     help="GPU expert slots as a fraction of all experts, in (0, 1] (exact requirement)")
    g.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default 16)")
    g.add_argument("--max-running-requests", type=int, default=None,
                   help="requests decoded together; sizes the linear-state pool (default 64)")
    g.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="tokens in one step, prefill chunks and decodes together (default 8192)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + output (default: the model's max_position_embeddings)")
    g.add_argument("--dtype", default=None, help="weights and KV dtype: auto, bfloat16, float16, float32")  # fmt: skip


def plan_request_from_args(args: argparse.Namespace) -> PlanRequest:
    return PlanRequest(**{name: getattr(args, name) for name in PLANNER_FIELDS})
