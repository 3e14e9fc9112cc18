"""`ferry plan --model DIR [flags] [--json]`: the worker's memory plan, computed on any machine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ferry.shared.model_flag import add_model_argument, require_model
from ferry.plan.host_memory import mem_available_bytes
from ferry.plan.model_config import load_model_config
from ferry.plan.costs import (
    resident_weight_bytes_from_checkpoint,
    resident_weight_bytes_from_shapes,
    workspace_bytes_estimate,
)
from ferry.plan.plan_report import plan_table
from ferry.plan.planner import Measured, resolve
from ferry.plan.planner_flags import add_planner_flags, plan_request_from_args
from ferry.plan.store_plan import plan_for_expert_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "a model directory holding config.json (safetensors optional)")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    add_planner_flags(parser)


def run(args: argparse.Namespace) -> int:
    model = require_model(args, "plan")
    spec = load_model_config(model)
    req = plan_request_from_args(args)
    r = resolve(spec, req)
    weights = resident_weight_bytes_from_checkpoint(Path(model), r.dtype)
    source = "safetensors"
    if weights is None:
        weights, source = resident_weight_bytes_from_shapes(spec, r.dtype), "shapes"
    workspace = workspace_bytes_estimate(spec, r.dtype, r.max_prefill_tokens, r.max_running_requests, r.max_model_len)
    free = None
    if req.gpu_memory is None:
        free = _local_free_memory()
    # host RAM: this machine's, as the worker would find it here (--host-memory plans for another one)
    measured = Measured(weights, workspace, free, source, "estimate", host_available_bytes=mem_available_bytes())
    plan = plan_for_expert_store(spec, req, measured)
    if args.json:
        json.dump(plan.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(plan_table(plan))
    return 0


def _local_free_memory() -> int | None:
    """The local GPU's free memory, when there is one (torch imported only here, only if present)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)
