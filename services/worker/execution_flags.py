"""How the worker executes steps: `--enforce-eager` and `--no-expert-prefetch`. Torch-free, so
commands that only forward flags (serve) can define them without importing the worker."""

from __future__ import annotations

import argparse


def add_execution_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never replay decode steps as CUDA graphs (by default a graph per batch-size bucket "
                             "is captured at boot and small decode steps replay it)")  # fmt: skip
    parser.add_argument("--expert-copy-engine-tokens", type=int, default=None, metavar="N",
                        help="decode steps of at least N tokens copy missed experts with the copy engine (the host "
                             "reads each layer's miss list) and run eagerly; by default only steps too large for "
                             "the graph-safe path (prefill) do, and decode copies with the GPU's cores")  # fmt: skip
    parser.add_argument("--no-expert-prefetch", dest="expert_prefetch", action="store_false",
                        help="do not copy the next MoE layer's predicted experts ahead (its router applied to the "
                             "current layer's input); only what a layer's own routing misses crosses PCIe")  # fmt: skip


def execution_flag_args(args: argparse.Namespace) -> list[str]:
    """The flags as a command line (ferry serve -> ferry worker)."""
    out = []
    if getattr(args, "enforce_eager", False):
        out.append("--enforce-eager")
    if not getattr(args, "expert_prefetch", True):
        out.append("--no-expert-prefetch")
    if getattr(args, "expert_copy_engine_tokens", None) is not None:
        out += ["--expert-copy-engine-tokens", str(args.expert_copy_engine_tokens)]
    return out
