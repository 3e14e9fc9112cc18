"""The worker's flags and its frozen boot configuration: one builder for `ferry worker`, `ferry
generate` and `ferry serve` (which passes them on to its worker), and one object boot reads.

Torch-free, so the commands that only forward flags (serve) define them without importing the
worker. The configuration is built once, in each command's `run`, and handed to
`boot_worker(cfg)` (services/worker/boot.py); boot never reads argparse (docs/ARCHITECTURE.md,
"Layout and the torch boundary")."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ferry.plan.expert_parallel import add_expert_parallel_flags, expert_parallel_size
from ferry.plan.planner import PlanRequest
from ferry.plan.planner_flags import BYTE_FIELDS, PLANNER_FIELDS, add_planner_flags, plan_request_from_args
from ferry.shared.model_flag import add_model_argument
from ferry.shared.speculation import SPECULATIVE_DRAFT_VOCAB_HELP

LOAD_FORMATS = ("auto", "safetensors", "dummy")
EXPERT_POLICIES = ("lfu", "lru")  # the names offload/stores/build.py's POLICIES maps to classes
DEFAULT_EXPERT_POLICY = "lfu"

EXPERT_POLICY_HELP = (
    "replacement policy of the GPU expert cache when experts are offloaded (default lfu): decode visits "
    "the layers in a cycle, so once a step routes to more experts than there are slots, LRU evicts exactly "
    "the experts the next layers need and its hit rate collapses, where LFU keeps the often-routed ones"
)

# With plain bf16 expert banks, decode steps of this many tokens or more copy their missed experts with the
# copy engine rather than the GPU's cores: on the 12-layer Qwen3-30B-A3B cut (top-8) at 8 streams the copy engine
# gave 93.0 tok/s against 86.4 for core copies in the CUDA graph; one stream is the same. Packed and quantized
# banks have no threshold by default: packed banks' unpacking copy delivers more bf16 bytes a second than the
# copy engine, and a quantized expert is a third of a bf16 one or less, so the eager, host-read path costs more
# than its copies save (the full-size 35B NVFP4 at 24 GiB: 118 tok/s at 8 streams that way, 514 in the graph).
DEFAULT_COPY_ENGINE_TOKENS = 8


def ring_chunk(requested: int | None, flag: str, staging_slots: int | None = None) -> int | None:
    """--prefill-ring-chunk or --long-prefill-ring-chunk (`flag`) as given, checked: at least one expert,
    at most the plan's staging slots (`staging_slots`, once the plan is made; None before)."""
    if requested is None:
        return None
    if requested < 1:
        raise ValueError(f"{flag} must be at least 1 expert, got {requested}")
    if staging_slots is not None and requested > staging_slots:
        raise ValueError(
            f"{flag} {requested}: a ring chunk must fit the plan's {staging_slots} prefill staging "
            f"slots (give at most {staging_slots})"
        )
    return requested


def copy_engine_tokens(requested: int | None, plain_bf16_banks: bool) -> int | None:
    """--expert-copy-engine-tokens as given, else the bank format's default (see above)."""
    if requested is not None and requested < 1:
        raise ValueError(f"--expert-copy-engine-tokens must be at least 1, got {requested}")
    if requested is None and plain_bf16_banks:
        return DEFAULT_COPY_ENGINE_TOKENS
    return requested


@dataclass(frozen=True)
class WorkerBootConfig:
    """Everything `boot_worker` needs to know, as the user gave it."""

    model: str  # a model directory, or a hub id already in the local cache
    revision: str | None = None  # hub revision of a hub id
    load_format: str = "auto"  # auto | safetensors | dummy
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    expert_policy: str = DEFAULT_EXPERT_POLICY
    enforce_eager: bool = False  # never replay decode steps as CUDA graphs
    expert_prefetch: bool = True  # copy the next MoE layer's predicted experts ahead
    expert_copy_engine_tokens: int | None = (
        None  # decode steps of this many tokens or more copy with the copy engine; None: by bank format
    )
    prefill_ring_chunk: int | None = (
        None  # experts a staging-ring chunk holds in a streamed step; None: a quarter of the staging slots
    )
    long_prefill_ring_chunk: int | None = (
        None  # the same in a long-context prefill step (it lends slots); None: prefill_ring_chunk's
    )
    speculative_draft_vocab: int = 0  # the MTP head drafts among the first N token ids; 0: all of them
    plan: PlanRequest = PlanRequest()
    expert_parallel_size: int = 1  # ranks the routed experts are partitioned over (services/worker/expert_ranks.py)
    expert_parallel_rank: int = 0  # this process's rank: 0 talks to the scheduler, the others follow it
    sampler_seed: int | None = None  # the noise of unseeded requests; the ranks share one (None: drawn at boot)
    # expert-parallel ranks: the host's MemAvailable as rank 0 read it before any rank pinned a bank
    # (None: read at boot)
    host_available_bytes: int | None = None


MODEL_HELP = "a Hugging Face model directory, or a hub id already in the local cache"


def add_worker_flags(
    parser: argparse.ArgumentParser, model_required: bool = True, positional_model: bool = False
) -> None:
    """Every flag WorkerBootConfig is built from. The model: `--model`, required (`ferry worker`); with
    `positional_model`, MODEL or --model (`ferry generate`; shared/model_flag.py, the command calls
    require_model); with `model_required=False` none: the caller adds it (`ferry serve`: the demo model)."""
    if positional_model:
        add_model_argument(parser, MODEL_HELP)
    elif model_required:
        parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of a hub id")
    parser.add_argument(
        "--load-format",
        choices=LOAD_FORMATS,
        default="auto",
        help="auto/safetensors: read the checkpoint; dummy: random weights of the right shapes",
    )
    parser.add_argument(
        "--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--expert-policy", choices=EXPERT_POLICIES, default=DEFAULT_EXPERT_POLICY, help=EXPERT_POLICY_HELP
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never replay decode steps as CUDA graphs (by default a graph per batch-size bucket "
        "is captured at boot and small decode steps replay it)",
    )
    parser.add_argument(
        "--no-expert-prefetch",
        dest="expert_prefetch",
        action="store_false",
        help="do not copy the next MoE layer's predicted experts ahead (its router applied to the "
        "current layer's input); only what a layer's own routing misses crosses PCIe",
    )
    parser.add_argument(
        "--expert-copy-engine-tokens",
        type=int,
        default=None,
        metavar="N",
        help="decode steps of at least N tokens read each layer's miss list on the host and run "
        "eagerly, copying with the copy engine (plain banks) or the unpacking kernel (packed); "
        "smaller ones copy with the GPU's cores inside a CUDA graph; a prefill of N+ tokens, and "
        "any step past 64 (token, k) pairs, takes the host-read path too (default: "
        f"{DEFAULT_COPY_ENGINE_TOKENS} with plain bf16 banks, none with packed or quantized ones)",
    )
    parser.add_argument(
        "--prefill-ring-chunk",
        type=int,
        default=None,
        metavar="N",
        help="experts a staging-ring chunk copies and computes in a streamed prefill step (the "
        "experts it lacks cross PCIe through the prefill staging slots in chunks, each computed "
        "as it lands): larger chunks pay the host's launches fewer times, smaller ones leave more "
        "bays to overlap copies with compute; at most the plan's staging slots (default: a "
        "quarter of them, four bays)",
    )
    parser.add_argument(
        "--long-prefill-ring-chunk",
        type=int,
        default=None,
        metavar="N",
        help="the same in a long-context prefill step (one that lends the ring cache slots: a chunk "
        "of 1,024+ tokens reaching 32k keys, with room for many bays); default: "
        "--prefill-ring-chunk's",
    )
    parser.add_argument(
        "--speculative-draft-vocab",
        type=int,
        default=0,
        metavar="N",
        help=SPECULATIVE_DRAFT_VOCAB_HELP,
    )
    add_planner_flags(parser)
    add_expert_parallel_flags(parser)


def boot_config_from_args(args: argparse.Namespace, model: str | None = None) -> WorkerBootConfig:
    """The frozen configuration; `model` replaces --model (serve resolves the demo model first)."""
    return WorkerBootConfig(
        model=model if model is not None else args.model,
        revision=args.revision,
        load_format=args.load_format,
        device=args.device,
        expert_policy=args.expert_policy,
        enforce_eager=args.enforce_eager,
        expert_prefetch=args.expert_prefetch,
        expert_copy_engine_tokens=args.expert_copy_engine_tokens,
        prefill_ring_chunk=args.prefill_ring_chunk,
        long_prefill_ring_chunk=args.long_prefill_ring_chunk,
        speculative_draft_vocab=args.speculative_draft_vocab,
        plan=plan_request_from_args(args),
        expert_parallel_size=expert_parallel_size(args),
    )


def worker_flag_args(cfg: WorkerBootConfig) -> list[str]:
    """The command line that rebuilds `cfg` in another process (ferry serve -> ferry worker)."""
    out = [
        "--model",
        cfg.model,
        "--load-format",
        cfg.load_format,
        "--device",
        cfg.device,
        "--expert-policy",
        cfg.expert_policy,
    ]
    if cfg.revision is not None:
        out += ["--revision", cfg.revision]
    if cfg.enforce_eager:
        out.append("--enforce-eager")
    if not cfg.expert_prefetch:
        out.append("--no-expert-prefetch")
    if cfg.expert_copy_engine_tokens is not None:
        out += ["--expert-copy-engine-tokens", str(cfg.expert_copy_engine_tokens)]
    if cfg.prefill_ring_chunk is not None:
        out += ["--prefill-ring-chunk", str(cfg.prefill_ring_chunk)]
    if cfg.long_prefill_ring_chunk is not None:
        out += ["--long-prefill-ring-chunk", str(cfg.long_prefill_ring_chunk)]
    if cfg.speculative_draft_vocab:
        out += ["--speculative-draft-vocab", str(cfg.speculative_draft_vocab)]
    if cfg.expert_parallel_size > 1:
        out += ["--expert-parallel-size", str(cfg.expert_parallel_size)]
    for name in PLANNER_FIELDS:
        value = getattr(cfg.plan, name)
        if value is not None:  # byte budgets with their unit: a bare number is refused
            out += ["--" + name.replace("_", "-"), f"{value}B" if name in BYTE_FIELDS else str(value)]
    return out
