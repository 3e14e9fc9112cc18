"""The plan of every GPU when the routed experts are partitioned across them (expert parallelism).

GPU g of N owns the experts e with e % N == g of every MoE layer (services/worker/offload/stores/expert_parallel.py):
its own slots, its own pinned host banks, its own misses over its own PCIe link. The dense weights, the
KV pool and the linear-state pools are replicated, so each GPU's plan is the one-GPU plan of a model
whose MoE layers have only that GPU's experts, with the same budget (`--gpu-memory` is per GPU) and the
dense weights and activation workspace of the whole model, plus NCCL's buffers.

NCCL allocates its buffers outside torch's allocator: per peer and channel a send and a receive buffer
of NCCL_BUFFSIZE (4 MiB by default), on up to NCCL_MAX_CHANNELS channels (32 on NVLink). That bound is
what each GPU's plan prices; the worker that runs it checks at boot that it held.

The host RAM is shared: the banks of every GPU are pinned in the one host, so their sum, with a reserve for
each rank's process, is what the host must hold (`check_ranks_host`: one check over all of them, made by
`ferry plan --gpus` and by the ranks together at boot, before any of them pins a bank).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ferry.plan.model_config import ModelSpec
from ferry.plan.plan_report import HOST_NOT_CHECKED
from ferry.plan.planner import DEFAULT_MAX_PREFILL_TOKENS, Measured, Plan, PlanRequest, Resolved
from ferry.plan.prefill_chunk import plan_with_prefill_chunk
from ferry.shared.errors import ConfigError, PlanError
from ferry.shared.units import MiB, format_bytes

NCCL_BUFFSIZE = 4 * MiB
NCCL_MAX_CHANNELS = 32


def nccl_workspace_bytes(world: int) -> int:
    """What NCCL may allocate on one GPU of `world`: a send and a receive buffer per peer and channel."""
    return 0 if world < 2 else 2 * (world - 1) * NCCL_MAX_CHANNELS * NCCL_BUFFSIZE


def owned_experts(num_experts: int, rank: int, world: int) -> int:
    """How many of a MoE layer's experts GPU `rank` owns (e % world == rank)."""
    return len(range(rank, num_experts, world))


def rank_spec(spec: ModelSpec, rank: int, world: int) -> ModelSpec:
    """The model as GPU `rank` holds its routed experts: every MoE layer with only its own."""
    # num_experts_per_tok stays: a token may route all k of its pairs to one GPU's experts, so its pair
    # buffers keep room for k a token
    return dataclasses.replace(spec, num_experts=owned_experts(spec.num_experts, rank, world))


def add_expert_parallel_flags(parser) -> None:
    """`--expert-parallel-size N` (alias `--gpus`), and vLLM's `--tensor-parallel-size N --enable-expert-parallel`:
    `ferry plan` plans every GPU, `ferry worker` and `ferry serve` run one worker process a rank."""
    g = parser.add_argument_group("expert parallelism")
    g.add_argument(
        "--expert-parallel-size",
        "--gpus",
        dest="expert_parallel_size",
        type=int,
        default=None,
        metavar="N",
        help="N ranks of one host (N GPUs, or N CPU processes with --device cpu), rank g "
        "owning the experts e %% N == g of every MoE layer (its slots, host banks and "
        "PCIe link); --gpu-memory is per GPU (default 1)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's spelling: with --enable-expert-parallel, the same as --expert-parallel-size N",
    )
    g.add_argument("--enable-expert-parallel", action="store_true", help="see --tensor-parallel-size")


def expert_parallel_size(args) -> int:
    """--expert-parallel-size (alias --gpus), or vLLM's --tensor-parallel-size N with --enable-expert-parallel;
    ConfigError naming the flag for a combination Ferry does not run."""
    ep, tp, enabled = args.expert_parallel_size, args.tensor_parallel_size, args.enable_expert_parallel
    if tp is not None and ep is not None and tp != ep:
        raise ConfigError(f"--tensor-parallel-size {tp} and --expert-parallel-size {ep} disagree: give one")
    if tp is not None and tp > 1 and not enabled and ep is None:
        raise ConfigError(
            f"--tensor-parallel-size {tp}: Ferry partitions the experts across GPUs, not the tensors; "
            f"add --enable-expert-parallel (or give --expert-parallel-size {tp})"
        )
    world = ep if ep is not None else (tp if tp is not None else 1)
    if world < 1:
        raise ConfigError(f"--expert-parallel-size must be at least 1, got {world}")
    return world


def check_ranks_host(banks: list[int], reserve: int, available: int | None, source: str) -> None:
    """PlanError unless the ranks' pinned banks (`banks`, one a rank) fit the host's `available` bytes together,
    with `reserve` kept for each rank's process (its own interpreter, CUDA context and buffers); nothing to
    check where `available` is unknown. `ferry plan --gpus` and the ranks' boot (before any bank is pinned)
    both check here: a rank that checked alone would see the host before the others pinned theirs."""
    world, total = len(banks), sum(banks)
    if not total or available is None:
        return
    if total + reserve * world > available:
        raise PlanError(
            f"the {world} GPUs' expert banks do not fit in host RAM: together they pin "
            f"{format_bytes(total)} plus {format_bytes(reserve)} kept for each of the {world} rank "
            f"processes, but {source} is {format_bytes(available)}; give fewer GPUs' experts to this "
            "host (--expert-parallel-size), or more --host-memory if the machine has it"
        )


def plan_every_gpu(
    spec: ModelSpec, req: PlanRequest, measured: Callable[[Resolved | None], Measured], here: int | None, world: int
) -> list[Plan]:
    """One plan per GPU (module docstring); `measured(step)` gives the whole model's weights and workspace,
    `here` this machine's MemAvailable (None: unknown). PlanError if the GPUs' banks together do not fit the host."""
    if world > spec.num_experts:
        raise ConfigError(f"--expert-parallel-size {world} exceeds the model's {spec.num_experts} experts a layer")
    nccl = nccl_workspace_bytes(world)

    def on_one_gpu(step: Resolved | None) -> Measured:
        m = measured(step)
        return dataclasses.replace(
            m,
            workspace_bytes=m.workspace_bytes + nccl,
            host_available_bytes=None,
            workspace_source=f"{m.workspace_source} + NCCL buffers {format_bytes(nccl)}",
        )

    # a rank streams nothing through a staging ring (boot.py), so 16,384 tokens would save it no copies
    plans = [
        plan_with_prefill_chunk(rank_spec(spec, g, world), req, on_one_gpu, longest=DEFAULT_MAX_PREFILL_TOKENS)
        for g in range(world)
    ]
    available, source = (req.host_memory, "--host-memory") if req.host_memory is not None else (here, "MemAvailable")
    banks = [p.host.expert_bank_bytes for p in plans]
    if (
        req.host_memory is None
        and req.gpu_memory is not None
        and available is not None
        and sum(banks) + plans[0].host.reserve_bytes * world > available
    ):
        # a --gpu-memory plan may be for another machine: banks this one cannot hold are not checked, not
        # failed, as in the one-GPU plan (plan_command._plan_and_host_check); --host-memory checks them
        return [
            dataclasses.replace(
                p, host=dataclasses.replace(p.host, available_bytes=None, available_source=HOST_NOT_CHECKED)
            )
            for p in plans
        ]
    check_ranks_host(banks, plans[0].host.reserve_bytes, available, source)
    src = source if available is not None else "unknown"
    return [
        dataclasses.replace(p, host=dataclasses.replace(p.host, available_bytes=available, available_source=src))
        for p in plans
    ]
