"""`ferry plan --model DIR [flags] [--json]`: the worker's memory plan, computed on any machine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable

from ferry.plan.costs import (
    resident_weight_bytes_from_checkpoint,
    resident_weight_bytes_from_shapes,
    workspace_bytes_estimate,
)
from ferry.plan.expert_parallel import add_expert_parallel_flags, expert_parallel_size, plan_every_gpu
from ferry.plan.gguf_checkpoint import GGUF_SUFFIX, find_gguf
from ferry.plan.host_memory import mem_available_bytes
from ferry.plan.model_config import ModelSpec, load_model_config
from ferry.plan.mtp_layer import mtp_resident_bytes, spec_for_method
from ferry.plan.outside_memory import estimated_outside
from ferry.plan.plan_report import HOST_NOT_CHECKED, plan_table
from ferry.plan.planner import Measured, Plan, PlanRequest, Resolved, resolve
from ferry.plan.planner_flags import add_planner_flags, plan_request_from_args
from ferry.plan.prefill_chunk import plan_with_prefill_chunk
from ferry.shared.errors import ConfigError
from ferry.shared.model_flag import add_model_argument
from ferry.shared.units import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(
        parser, "a model directory holding config.json, or that config.json (safetensors optional), or a .gguf file"
    )
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    add_planner_flags(parser)
    add_expert_parallel_flags(parser)


def run(args: argparse.Namespace) -> int:
    req = plan_request_from_args(args)
    model, free = _model_and_free_memory(args, req)
    spec = spec_for_method(load_model_config(model), req.speculative_method)
    r = resolve(spec, req)
    weights = resident_weight_bytes_from_checkpoint(model, r.dtype, spec)
    source = "safetensors"
    if weights is None:
        weights, source = resident_weight_bytes_from_shapes(spec, r.dtype), "shapes"
        if find_gguf(model) is not None:  # the worker dequantizes a GGUF's dense tensors as it loads them
            source = f"shapes: the GGUF's dense tensors, dequantized to {r.dtype} at load"
    if spec.mtp_kv_layers:  # --speculative-method mtp: the draft head's weights, as the worker allocates them
        mtp_weights = mtp_resident_bytes(spec, r.dtype)
        weights += mtp_weights
        source += f"; the MTP layer's {format_bytes(mtp_weights)} of them (plan/mtp_layer.py)"

    outside = estimated_outside(budget_from_free_memory=req.gpu_memory is None)

    def measured(step: Resolved | None) -> Measured:
        workspace = (
            0
            if step is None
            else workspace_bytes_estimate(
                spec, step.dtype, step.max_prefill_tokens, step.max_running_requests, step.max_model_len
            )
        )
        return Measured(weights, workspace, free, source, "estimate", outside=outside)

    world = expert_parallel_size(args)
    if world > 1:
        here = mem_available_bytes()
        plans = plan_every_gpu(spec, req, measured, here, world)
        if args.json:
            json.dump({"expert_parallel_size": world, "gpus": [p.to_dict() for p in plans]}, sys.stdout)
            sys.stdout.write("\n")
        else:
            unchecked = plans[0].host.available_source == HOST_NOT_CHECKED
            for g, p in enumerate(plans):
                print(
                    f"GPU {g} of {world}: experts e % {world} == {g}, "
                    f"{p.experts.total // max(len(spec.moe_layer_indices), 1)}"
                    f" of {spec.num_experts} a MoE layer; dense weights, KV and linear states replicated"
                )
                print(plan_table(p, host_here=here if unchecked else None) + ("\n" if g < world - 1 else ""))
            total = sum(p.host.expert_bank_bytes + p.host.reserve_bytes for p in plans)
            print(
                f"host: the {world} GPUs' banks together pin "
                f"{format_bytes(sum(p.host.expert_bank_bytes for p in plans))}"
                + (
                    f"; not checked: with the ranks' reserves they need {format_bytes(total)}, this machine has "
                    f"{format_bytes(here)} (MemAvailable); "
                    "give --host-memory SIZE of the machine the worker will run on"
                    if unchecked
                    else ""
                )
            )
        return 0
    plan, here = _plan_and_host_check(spec, req, measured, mem_available_bytes())
    if args.json:
        json.dump(plan.to_dict(), sys.stdout)
        sys.stdout.write("\n")
    else:
        print(plan_table(plan, host_here=here))
    return 0


def _model_and_free_memory(args: argparse.Namespace, req: PlanRequest) -> tuple[Path, int | None]:
    """The model directory and the local GPU's free memory (None with --gpu-memory), or one error
    naming everything missing: a newcomer should not learn the required flags one failure at a time."""
    missing = []
    model = getattr(args, "model", None)
    if not model:
        missing.append("the model: `ferry plan MODEL` or `ferry plan --model MODEL` (a directory holding config.json)")
    free = None
    if req.gpu_memory is None:
        free = _local_free_memory()
        if free is None:
            missing.append(
                "the device budget: there is no GPU here to measure, so give it with --gpu-memory "
                "(e.g. --gpu-memory 24GiB)"
            )
    if missing:
        raise ConfigError(
            "the plan needs " + ("these" if len(missing) > 1 else "this") + ":\n" + "\n".join(f"  {m}" for m in missing)
        )
    return _model_dir(model, getattr(args, "revision", None)), free


def _model_dir(model: str, revision: str | None) -> Path:
    """The model directory, also when given as its config.json (what a shell's completion offers) or as a
    hub id in the local cache; a missing one is an error naming --model."""
    from ferry.services.worker.model_source import resolve_model_dir

    path = Path(model).expanduser()
    if path.is_file() and path.suffix != GGUF_SUFFIX:
        if path.name != "config.json":
            raise ConfigError(
                f"{model} is a file: give the model directory (the one holding config.json), its config.json, "
                "or a .gguf file"
            )
        return path.parent
    return resolve_model_dir(model, revision)


def _plan_and_host_check(
    spec: ModelSpec, req: PlanRequest, measured: Callable[[Resolved | None], Measured], here: int | None
) -> tuple[Plan, int | None]:
    """The plan, with its host-RAM check against --host-memory, else this machine's MemAvailable
    (`here`). A plan whose budget is --gpu-memory may well be for another machine: there, banks that
    do not fit this machine's RAM are shown as not checked instead of failing the plan; with the
    budget measured from this machine's GPU, or with --host-memory, they fail it (rule 4). Returns
    the plan and, when its host check was skipped, this machine's MemAvailable for the table."""

    def checked(step: Resolved | None) -> Measured:
        return dataclasses.replace(measured(step), host_available_bytes=here)

    def host_unchecked(step: Resolved | None) -> Measured:
        return dataclasses.replace(measured(step), host_available_bytes=None)

    if req.host_memory is not None or req.gpu_memory is None or here is None:
        return plan_with_prefill_chunk(spec, req, checked), None
    unchecked = plan_with_prefill_chunk(spec, req, host_unchecked)
    host = unchecked.host
    if not host.expert_bank_bytes or host.expert_bank_bytes + host.reserve_bytes <= here:
        return plan_with_prefill_chunk(spec, req, checked), None  # fits this machine too: say so
    return dataclasses.replace(unchecked, host=dataclasses.replace(host, available_source=HOST_NOT_CHECKED)), here


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
