"""`ferry worker-rank`: rank r > 0 of an expert-parallel worker, started by rank 0 (`ferry worker
--expert-parallel-size N`) with its own flags: it joins the ranks' group, boots its share of the experts
and executes the steps rank 0 hands on (services/worker/expert_ranks.py). Not for starting by hand."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal

from ferry.services.worker.flags import add_worker_flags, boot_config_from_args
from ferry.shared.logging import add_log_flags, configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_flags(parser)
    g = parser.add_argument_group("rank")
    g.add_argument("--rendezvous", required=True, help="the file rank 0 made for the group to meet in")
    g.add_argument("--expert-parallel-rank", type=int, required=True, help="this process's rank, 1..N-1")
    add_log_flags(parser)


def run(args: argparse.Namespace) -> int:
    configure_logging("worker", args.log_level, args.log_format)
    import structlog

    from ferry.services.worker.boot import boot_worker
    from ferry.services.worker.device import select_device
    from ferry.services.worker.expert_ranks import (
        HOST_AVAILABLE_ENV,
        SEED_ENV,
        RankGroup,
        check_same_plans,
        follow,
        init_group,
        leave_group,
    )
    from ferry.shared.startup_heap import freeze_startup_heap

    cfg = boot_config_from_args(args)
    rank, world = args.expert_parallel_rank, cfg.expert_parallel_size
    if not 0 < rank < world:
        raise SystemExit(f"ferry worker-rank: --expert-parallel-rank must be in 1..{world - 1}, got {rank}")
    device = rank_device(cfg.device, rank)
    seed = int(os.environ[SEED_ENV])  # rank 0's sampler seed: the ranks draw alike
    available = os.environ.get(HOST_AVAILABLE_ENV)  # the host before any rank pinned (rank 0 read it)
    cfg = dataclasses.replace(
        cfg,
        expert_parallel_rank=rank,
        device=device,
        sampler_seed=seed,
        host_available_bytes=int(available) if available else None,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 stops the followers (a terminal's Ctrl-C reaches all)
        signal.signal(sig, signal.SIG_IGN)
    structlog.contextvars.bind_contextvars(rank=rank)
    group = RankGroup(rank, world, init_group(rank, world, args.rendezvous, select_device(device)), [])
    try:
        executor, plan = boot_worker(cfg)
        check_same_plans(group, plan)
    except BaseException:
        leave_group()
        raise
    freeze_startup_heap()  # a full collection in a follower would stall every rank's step (shared/startup_heap.py)
    follow(group, executor)
    return 0


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th visible GPU where the worker's is the default one, else the worker's own
    (the CPU; a single GPU named by --device cuda:K is refused for more than one rank: check_rank_devices)."""
    if device in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():
            return f"cuda:{rank}"
    return device
