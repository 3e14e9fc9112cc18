"""The flags of the worker's boot (`ferry generate`, the bench scripts), torch-free so that
`ferry generate --help` prints without importing torch."""

from __future__ import annotations

import argparse

from ferry.shared.model_flag import add_model_argument
from ferry.services.worker.execution_flags import add_execution_flags
from ferry.services.worker.expert_policy_flag import add_expert_policy_flag
from ferry.plan.planner_flags import add_planner_flags

LOAD_FORMATS = ("auto", "safetensors", "dummy")


def add_boot_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "a Hugging Face model directory, or a hub id already in the local cache")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of a hub id")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                        help="auto/safetensors: read the checkpoint; dummy: random weights of the right shapes")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default auto: cuda if available, else cpu)")
    add_expert_policy_flag(parser)
    add_execution_flags(parser)
    add_planner_flags(parser)  # fmt: skip
