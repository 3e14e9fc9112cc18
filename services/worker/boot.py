"""Worker boot, in the order of DESIGN §2 rule 3: measure, load dense weights, measure them,
profile the workspace, plan, allocate the pools, load the experts.

    free memory ─▶ dense weights ─▶ weight bytes ─▶ workspace ─▶ plan ─▶ pools ─▶ experts

Everything the planner is given is a measurement of this process on this device, except on
CPU, where there is no allocator to ask: weights are counted from the parameters and the
workspace is estimated (costs.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from itertools import chain

import torch

from shared.errors import ConfigError, FerryError
from shared.units import MiB, format_bytes
from services.worker.costs import workspace_bytes_estimate
from services.worker.executor import StepExecutor
from services.worker.experts import ResidentExperts
from services.worker.late_bound_experts import LateBoundExperts
from services.worker.loader import LOAD_FORMATS, open_model, resident_weights, routed_expert_weights
from services.worker.plan_report import plan_log_fields
from services.worker.planner import Measured, Plan, PlanRequest, make_plan, resolve
from services.worker.planner_flags import add_planner_flags, plan_request_from_args
from services.worker.pools import TORCH_DTYPES, allocate_pools
from services.worker.workspace_profile import profile_workspace_cuda

log = logging.getLogger("ferry.worker")

# Without --gpu-memory a CPU run gets this much (or half the available RAM, if less): the
# planner fills its budget with KV pages, and a CPU run should not claim the machine's memory.
CPU_DEFAULT_BUDGET = 512 * MiB


class MemoryBudgetExceeded(FerryError):
    """The worker reserved more device memory than --gpu-memory allows."""

    exit_status = 2


def add_boot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a Hugging Face model directory, or a hub id already in the local cache")
    parser.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of a hub id")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                        help="auto/safetensors: read the checkpoint; dummy: random weights of the right shapes")
    parser.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default auto: cuda if available, else cpu)")
    add_planner_flags(parser)  # fmt: skip


def resolve_device(name: str | None) -> torch.device:
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"--device {name!r} is not a device: use cpu, cuda or cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r}: Ferry runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: torch sees no CUDA device here (use --device cpu)")
    return device


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (no psutil): what a CPU run may use without swapping."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _free_memory(device: torch.device, req: PlanRequest) -> tuple[int | None, PlanRequest]:
    """Free device memory, and the request with a CPU default budget filled in when none was given."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free), req
    available = host_available_bytes()
    if req.gpu_memory is None:
        default = CPU_DEFAULT_BUDGET if available is None else min(CPU_DEFAULT_BUDGET, available // 2)
        log.warning("no --gpu-memory on CPU: budget %s (the CPU default, min(%s, half of MemAvailable%s)); "
                    "set --gpu-memory to change it", format_bytes(default), format_bytes(CPU_DEFAULT_BUDGET),
                    "" if available is None else f" {format_bytes(available)}")  # fmt: skip
        req = dataclasses.replace(req, gpu_memory=default)
    return available, req


def _allocated(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return 0


def _tensor_bytes(model: torch.nn.Module) -> int:
    storages = {}
    for t in chain(model.parameters(), model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def check_expert_store_possible(plan: Plan) -> None:
    if plan.experts.slots < plan.experts.total:
        raise ConfigError(
            f"the plan gives {plan.experts.slots} of {plan.experts.total} expert slots: this model needs expert "
            "offload, which this worker does not have yet. Give more memory (--gpu-memory) or a smaller KV pool "
            "(--num-tokens / --kv-reserve-tokens) so every expert fits"
        )


def build_expert_store(spec, plan: Plan, pools) -> ResidentExperts:
    """The store over the planned slot pool: every expert in its own slot. (The offloading store,
    for plans with fewer slots than experts, plugs in here and in check_expert_store_possible.)"""
    return ResidentExperts(pools.experts, len(spec.moe_layer_indices), spec.num_experts)


def _then(step: Callable[[], None], tensors: Callable[[], Iterable]) -> Iterator:
    """A lazy tail for load_weights: `step` runs when every tensor before it has been consumed."""
    step()
    yield from tensors()


def boot_worker(args: argparse.Namespace) -> tuple[StepExecutor, Plan]:
    device = resolve_device(getattr(args, "device", None))
    files = open_model(args.model, args.load_format, getattr(args, "revision", None))
    spec = files.spec
    free, req = _free_memory(device, plan_request_from_args(args))
    r = resolve(spec, req)
    dtype = TORCH_DTYPES[r.dtype]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    from services.worker.models import build_model

    before = _allocated(device)
    experts = LateBoundExperts(spec.num_experts)
    model = build_model(spec, dtype, device, experts)
    booted: dict = {}

    def plan_and_allocate() -> None:
        """Runs between the two weight passes: the dense weights are in, the experts not yet."""
        if device.type == "cuda":
            weights = _allocated(device) - before
            # profiling resets the allocator's peak counters: keep the peak of loading
            booted["loading_peak_reserved"] = torch.cuda.max_memory_reserved(device)
            workspace, workspace_source = profile_workspace_cuda(model, experts, spec, r, device), "profiled"
        else:
            weights = _tensor_bytes(model)
            workspace = workspace_bytes_estimate(spec, r.dtype, r.max_prefill_tokens, r.max_running_requests,
                                                 r.max_model_len)  # fmt: skip
            workspace_source = "estimate"
        plan = make_plan(spec, req, Measured(weights, workspace, free, "measured", workspace_source))
        check_expert_store_possible(plan)  # before any pool is allocated (rule 4)
        pools = allocate_pools(spec, plan, device)
        store = build_expert_store(spec, plan, pools)
        experts.bind(store)
        booted.update(plan=plan, pools=pools, store=store)

    model.load_weights(
        chain(
            resident_weights(files, dtype, device),
            _then(plan_and_allocate, lambda: routed_expert_weights(files, dtype, device)),
        )
    )
    plan: Plan = booted["plan"]
    preload = getattr(booted["store"], "preload", None)  # a caching store warms its slots once experts are in
    if callable(preload):
        preload()
    _check_budget(device, req, free, booted.get("loading_peak_reserved", 0))
    log.info("plan %s", json.dumps(dict(plan_log_fields(plan), model=str(files.model_dir), device=str(device),
                                        load_format=files.load_format)))  # fmt: skip
    return StepExecutor(model, booted["pools"], spec, plan, device), plan


def _check_budget(device: torch.device, req: PlanRequest, free: int | None, earlier_peak: int) -> None:
    """--gpu-memory is a promise: after boot, what the process ever reserved must be within it."""
    if device.type != "cuda":
        return
    limit = req.gpu_memory if req.gpu_memory is not None else free
    reserved = max(torch.cuda.max_memory_reserved(device), earlier_peak)
    if limit is not None and reserved > limit:
        what = f"--gpu-memory {format_bytes(limit)}" if req.gpu_memory is not None else f"free memory {format_bytes(limit)}"
        raise MemoryBudgetExceeded(
            f"boot reserved {format_bytes(reserved)} of device memory, more than {what}; lower --memory-ratio "
            "to leave the allocator more headroom"
        )
