"""The planner's command-line flags, shared by `ferry plan`, `ferry worker`, `ferry serve` and `ferry generate`."""

from __future__ import annotations

import argparse

from ferry.plan.dtypes import DTYPE_BYTES, normalize_dtype
from ferry.plan.expert_backend import EXPERT_BACKENDS, RESERVED_CORES
from ferry.plan.host_memory import BANK_FORMATS
from ferry.plan.planner import DEFAULT_MEMORY_RATIO, PlanRequest
from ferry.plan.pool_layout import KV_CACHE_DTYPES
from ferry.shared.errors import ConfigError
from ferry.shared.speculation import SPECULATIVE_METHOD_HELP, SPECULATIVE_METHODS, SPECULATIVE_TOKENS_HELP
from ferry.shared.units import parse_bytes

PLANNER_FIELDS = (
    "gpu_memory",
    "memory_ratio",
    "num_tokens",
    "num_pages",
    "kv_reserve_tokens",
    "moe_cache_size",
    "moe_cache_rate",
    "page_size",
    "max_running_requests",
    "max_prefill_tokens",
    "max_model_len",
    "dtype",
    "host_memory",
    "expert_bank_format",
    "linear_state_snapshots",
    "expert_backend",
    "host_expert_threads",
    "host_expert_cpus",
    "kv_cache_dtype",
    "speculative_method",
    "speculative_tokens",
)
# the fields that are byte sizes (forwarded to a child process with their unit: `--gpu-memory 123B`)
BYTE_FIELDS = ("gpu_memory", "host_memory")


def _byte_size(flag: str):
    """argparse type of a budget flag: a size with a unit. A bare number is refused with the form to
    use; one in (0, 1] is most likely vLLM's --gpu-memory-utilization, so the message says so."""

    def parse(text: str) -> int:
        try:
            return parse_bytes(text, require_unit=True)
        except ValueError as exc:
            message = str(exc)
            try:
                fraction = 0 < float(text) <= 1
            except ValueError:
                fraction = False
            if fraction:
                message += f" (a fraction of the device is --gpu-memory-utilization {text}, the same as --memory-ratio)"
            raise argparse.ArgumentTypeError(f"{message}; e.g. {flag} 24GiB") from exc

    parse.__name__ = "byte size"  # argparse names the type in some messages
    return parse


# --dtype's values: auto (the checkpoint's dtype) and the run dtypes; bf16, fp16, half, fp32 name them too
DTYPE_CHOICES = ("auto", *DTYPE_BYTES)


def _dtype(text: str) -> str:
    """argparse type of --dtype: refused at parse time with every choice, auto included."""
    if text.lower() == "auto":
        return "auto"
    try:
        return normalize_dtype(text)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: choose one of {', '.join(DTYPE_CHOICES)}") from None


_dtype.__name__ = "dtype"  # argparse names the type in some messages


def add_planner_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("memory plan")
    g.add_argument(
        "--gpu-memory",
        type=_byte_size("--gpu-memory"),
        default=None,
        metavar="SIZE",
        help="device memory the worker may use, with a unit: 24GiB, 80GB (default: the GPU's free memory); "
        "never exceeded",
    )
    g.add_argument(
        "--memory-ratio",
        "--gpu-memory-utilization",
        "--mem-fraction-static",
        dest="memory_ratio",
        type=float,
        default=None,
        help="fraction of --gpu-memory (or of the GPU's free memory) handed to the planner (default "
        f"{DEFAULT_MEMORY_RATIO:g}: what lives outside the plan is measured at boot and priced); "
        "--gpu-memory-utilization (vLLM) and --mem-fraction-static (SGLang) are the same flag",
    )
    g.add_argument(
        "--host-memory",
        type=_byte_size("--host-memory"),
        default=None,
        metavar="SIZE",
        help="host RAM the offloaded experts' pinned banks may take, with a unit: 64GiB (default: this "
        "machine's MemAvailable); give it to `ferry plan` for another machine",
    )
    g.add_argument(
        "--expert-bank-format",
        choices=BANK_FORMATS,
        default=None,
        help="how the offloaded experts are kept in host RAM: packed (bf16 only: losslessly in 12 bits a "
        "value, so a quarter fewer bytes in RAM and across PCIe, unpacked by the GPU as it copies), "
        "plain (as the GPU slots hold them), auto (default: packed for bf16 models, else plain)",
    )
    kv = g.add_mutually_exclusive_group()
    kv.add_argument(
        "--num-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens of context (exact requirement; sliding layers kept in rings hold only their "
        "window, plan/kv_groups.py)",
    )
    kv.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages (exact requirement)")
    g.add_argument(
        "--kv-reserve-tokens",
        type=int,
        default=None,
        help="lower bound on KV tokens; automatic sizing may give more (default: --max-model-len)",
    )
    moe = g.add_mutually_exclusive_group()
    moe.add_argument("--moe-cache-size", type=int, default=None, help="GPU expert slots (exact requirement)")
    moe.add_argument(
        "--moe-cache-rate",
        type=float,
        default=None,
        help="GPU expert slots as a fraction of all experts, in (0, 1] (exact requirement)",
    )
    g.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default 16)")
    g.add_argument(
        "--max-running-requests",
        "--max-num-seqs",
        dest="max_running_requests",
        type=int,
        default=None,
        help="requests decoded together; sizes the linear-state pool (default: 64 where every expert then has a "
        "GPU slot, else 8, halved until the plan fits); "
        "--max-num-seqs (vLLM) is the same flag",
    )
    g.add_argument(
        "--max-prefill-tokens",
        "--max-num-batched-tokens",
        dest="max_prefill_tokens",
        type=int,
        default=None,
        help="tokens in one step, prefill chunks and decodes together (default: chosen from memory, "
        "8192, 4096 or 2048, and 16384 or 32768 where --max-model-len or a KV flag asks for prompts past 16384: "
        "the chunk moving the fewest offloaded experts over PCIe, 8192 at most with every expert resident); "
        "--max-num-batched-tokens (vLLM) is the same flag",
    )
    g.add_argument(
        "--max-model-len",
        "--context-length",
        dest="max_model_len",
        type=int,
        default=None,
        help="longest sequence, prompt + output (default: the model's max_position_embeddings where every expert "
        "then has a GPU slot, else the longest power of two from 8192 whose KV takes at most 1/32 of the "
        "budget, halved until the plan fits); "
        "--context-length (SGLang) is the same flag",
    )
    g.add_argument(
        "--linear-state-snapshots",
        type=int,
        default=None,
        metavar="N",
        help="hybrid models (Gated DeltaNet): linear-state snapshots kept for the prefix cache, each the "
        "whole recurrent and conv state of a sequence at a cached prefix's end (61.4 MiB for "
        "Qwen3.6-35B-A3B); 0 turns prefix reuse off for them (default: 2 x --max-running-requests, 1 x "
        "where experts are offloaded, at most 1/16 of the budget, fewer if they would not fit beside the "
        "other pools' floors)",
    )
    g.add_argument(
        "--expert-backend",
        choices=EXPERT_BACKENDS,
        default=None,
        help="who computes the experts a step misses with experts offloaded on CUDA: gpu (each crosses "
        "PCIe), hybrid (the host computes part of each layer's misses where they lie in host RAM "
        "while the rest cross, split by costs measured at boot), cpu (the host computes every miss), "
        "auto (default: hybrid for decode layers where the host has cores to spare and the boot's "
        "calibration says it shortens a layer; prefills stay on the GPU, hybrid shares them too)",
    )
    g.add_argument(
        "--host-expert-threads",
        type=int,
        default=None,
        metavar="N",
        help="the host's expert kernel threads for --expert-backend hybrid, cpu or auto (default: the "
        f"physical cores minus {RESERVED_CORES}, for the api, the scheduler, the worker's launching "
        "thread and the rest of the machine)",
    )
    g.add_argument(
        "--host-expert-cpus",
        default=None,
        metavar="auto|none|LIST",
        help="where the host's expert threads run, one a CPU: auto (default: one a physical core, the "
        "last cores this process may use, the first left to the processes), none (unpinned), or a "
        "CPU list such as 4-15 (its first CPU is the caller's: the thread that hands a decode layer to the "
        "host pins itself there; the others are the workers')",
    )
    g.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        metavar="DTYPE",
        help=f"weights and KV dtype: {', '.join(DTYPE_CHOICES)} (default auto: the checkpoint's)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="how the KV pool stores K and V: auto (default: the --dtype) or fp8 (float8 e4m3 values "
        "with one float32 scale per token and kv head: about half the bytes a token of bf16, so "
        "more expert slots or KV tokens in the same memory; logprobs move slightly, README)",
    )
    # mtp plans the MTP layer's weights and K/V (plan/mtp_layer.py); the scheduler reads the same flag to draft
    g.add_argument(
        "--speculative-method", default=None, metavar="|".join(SPECULATIVE_METHODS), help=SPECULATIVE_METHOD_HELP
    )
    # the worker captures the verify steps' graphs (and the MTP chain's) for up to K drafts a row
    g.add_argument("--speculative-tokens", type=int, default=None, metavar="K", help=SPECULATIVE_TOKENS_HELP)


def plan_request_from_args(args: argparse.Namespace) -> PlanRequest:
    return PlanRequest(**{name: getattr(args, name) for name in PLANNER_FIELDS})
