"""The ranks of an expert-parallel worker: one process a rank, rank 0 the worker the scheduler knows.

`--expert-parallel-size N`: rank g owns the experts e % N == g of every MoE layer
(offload/stores/expert_parallel.py; its plan: plan/expert_parallel.py). Rank 0 is `ferry worker` as always: it
talks to the scheduler, and it starts ranks 1..N-1 as `ferry worker-rank` processes of its own
(`start_followers`) with the same flags. All N join one torch.distributed group (NCCL on CUDA, gloo on
CPU; a file rendezvous in a private directory) plus a gloo group for control messages.

Every step runs on every rank: rank 0 broadcasts each StepBatch before it launches it (`share_step`),
the followers execute the same steps in the same order (`follow`), and inside each MoE layer the ranks
sum their partial outputs. They draw the same random numbers (rank 0 hands its sampler's seed to the others,
and each makes the same draws in the same order), so a sampled token is the same on every rank and a
step fed from the one before stays identical.
Only rank 0 answers the scheduler.

A rank that fails takes its group down: rank 0 watches its followers' processes; when one exits, the
step in flight fails with the rank's exit named, and rank 0 exits, which the scheduler sees as a dead
worker (its requests fail, /health answers 503). A follower exits when rank 0 does (the control
group's receive fails) or when its parent goes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import torch.distributed as dist

from ferry.services.worker.executor import StepBatchError
from ferry.shared.child_process import die_with_parent
from ferry.shared.errors import ConfigError

log = structlog.get_logger("worker.ranks")

GROUP_TIMEOUT_S = 600.0  # a collective no rank completes for this long fails (a hung rank)
SEED_ENV = "FERRY_RANK_SAMPLER_SEED"  # rank 0's sampler seed, for the followers
HOST_AVAILABLE_ENV = "FERRY_RANK_HOST_AVAILABLE"  # MemAvailable as rank 0 read it before the ranks started
SEED = 0  # every rank seeds its generators alike: the same samples on every rank
CONTROL_TIMEOUT = datetime.timedelta(days=365)  # a follower waits for the next step as long as the server idles
FOLLOWER_FAILED_EXIT = 4  # a follower whose step failed past its checks: its collectives no longer pair with rank 0's


@dataclass
class RankGroup:
    rank: int
    world: int
    control: object  # the gloo group control messages travel in
    followers: list[subprocess.Popen]  # rank 0's: ranks 1..N-1
    rendezvous: str = ""  # rank 0's: the group's file, in a directory of its own
    watch: FollowerWatch | None = None  # rank 0's


def check_rank_devices(device: str, world: int) -> None:
    """ConfigError unless `world` ranks can each have a device: the CPU, or one visible GPU each."""
    if device.startswith("cuda:"):
        raise ConfigError(
            f"--device {device} with --expert-parallel-size {world}: the ranks take the first {world} "
            "visible GPUs; give --device cuda and choose them with CUDA_VISIBLE_DEVICES"
        )
    if device in ("auto", "cuda") and torch.cuda.is_available() and torch.cuda.device_count() < world:
        raise ConfigError(
            f"--expert-parallel-size {world} needs {world} GPUs, and {torch.cuda.device_count()} "
            "are visible (CUDA_VISIBLE_DEVICES)"
        )


PLAN_FIGURES = (
    "kv pages",
    "page size",
    "linear-state slots",
    "linear-state snapshots",
    "max running requests",
    "max prefill tokens",
    "max model len",
)


def plan_figures(plan) -> tuple[int, ...]:
    """What every rank's plan must agree on: the scheduler plans steps by rank 0's, and a step another rank's
    plan cannot hold would fail there alone, leaving the ranks' collectives unpaired."""
    return (
        plan.kv.pages,
        plan.kv.page_size,
        plan.linear_state.slots,
        plan.linear_state_snapshots.snapshots,
        plan.max_running_requests,
        plan.max_prefill_tokens,
        plan.max_model_len,
    )


def check_same_plans(group: RankGroup, plan) -> None:
    """Every rank, after its boot: ConfigError (on every rank alike) unless all planned the same pools."""
    figures: list = [None] * group.world
    dist.all_gather_object(figures, plan_figures(plan), group=group.control)
    if len(set(figures)) > 1:
        differ = [name for i, name in enumerate(PLAN_FIGURES) if len({f[i] for f in figures}) > 1]
        raise ConfigError(
            f"the {group.world} expert-parallel ranks planned different pools ({', '.join(differ)}: "
            f"{[dict(zip(PLAN_FIGURES, f)) for f in figures]}); fix them with --num-pages, "
            "--max-running-requests and --max-prefill-tokens"
        )


def init_group(rank: int, world: int, rendezvous: str, device: torch.device) -> object:
    """Join the ranks' group (NCCL on CUDA, gloo on CPU) and make the control group (gloo); returns it."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    if device.type == "cuda" and device.index is not None:  # NCCL binds a rank to the current device
        torch.cuda.set_device(device)
    # one host: the groups' sockets on loopback, not on an interface the rest of the network reaches
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timeout)
    torch.manual_seed(SEED)
    # the followers wait in the control group's broadcast for as long as the server is idle: no timeout
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def start_followers(
    world: int, worker_flags: list[str], sampler_seed: int, host_available: int | None = None
) -> tuple[list[subprocess.Popen], str]:
    """Rank 0: start ranks 1..world-1 (`ferry worker-rank`) with the worker's own flags, its sampler's seed
    and the host's MemAvailable as it read it (`host_available`, None: unknown); returns them and the
    rendezvous file rank 0 joins too."""
    rundir = Path(tempfile.mkdtemp(prefix="ferry-ranks-"))  # 0700
    rendezvous = str(rundir / "rendezvous")
    cmd = [sys.executable, "-m", "ferry.services.cli", "worker-rank", "--rendezvous", rendezvous, *worker_flags]
    env = {**os.environ, SEED_ENV: str(sampler_seed)}  # not on the command line, which any local user reads
    if host_available is not None:
        env[HOST_AVAILABLE_ENV] = str(host_available)
    followers = [
        subprocess.Popen([*cmd, "--expert-parallel-rank", str(r)], env=env, preexec_fn=die_with_parent(os.getpid()))
        for r in range(1, world)
    ]
    log.info("expert_parallel_followers", world=world, pids=[p.pid for p in followers])
    return followers, rendezvous


def leave_group() -> None:
    """A rank whose boot failed leaves the group before its process ends: one that exits with its gloo or
    NCCL group alive can abort in the group's destructor at interpreter exit (SIGABRT instead of the boot
    error's exit status: seen about once in 25 runs of the ranks' host check), and a rank still waiting in
    a collective with it hears the group close instead of waiting out GROUP_TIMEOUT_S."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # leaving is best effort: the boot's own error is what is raised
            dist.destroy_process_group()


def remove_rendezvous(rendezvous: str) -> None:
    """Rank 0, when the worker ends: the group's private directory."""
    shutil.rmtree(Path(rendezvous).parent, ignore_errors=True)


def share_step(group: RankGroup, batch, answered: tuple[int, bytes] | None = None) -> None:
    """Rank 0: hand the followers the step it is about to launch (None: stop), with the step id and sampled
    tokens of the last step it answered, for them to check they sampled the same (`follow`)."""
    payload = [pickle.dumps((batch, answered), protocol=pickle.HIGHEST_PROTOCOL)]
    dist.broadcast_object_list(payload, src=0, group=group.control)


def receive_step(group: RankGroup):
    """A follower: (the next step rank 0 launches or None: stop, rank 0's last answered (step id, tokens))."""
    payload = [None]
    dist.broadcast_object_list(payload, src=0, group=group.control)
    return pickle.loads(payload[0])


class DivergedRank(RuntimeError):
    """A follower sampled other tokens than rank 0 for the same step: their states have parted."""


def failed_follower(group: RankGroup) -> str | None:
    """Rank 0: what ended a follower that is no longer running, or None while all run."""
    for rank, proc in enumerate(group.followers, start=1):
        code = proc.poll()
        if code is not None:
            return f"expert-parallel rank {rank} of {group.world} exited with status {code}"
    return None


def follow(group: RankGroup, executor) -> None:
    """A follower's loop: execute what rank 0 shares until it says stop, or goes. Each step's sampled tokens
    are kept until rank 0 says what it answered for that step: other tokens raise DivergedRank (the
    process exits, and rank 0 fails the step: the ranks' hidden states would no longer agree)."""
    parent = os.getppid()
    sampled: dict[int, bytes] = {}
    while True:
        try:
            batch, answered = receive_step(group)
        except RuntimeError as exc:  # rank 0 is gone: the group with it
            log.error("expert_parallel_rank0_lost", rank=group.rank, error=str(exc))
            return
        if answered is not None and sampled.pop(answered[0], answered[1]) != answered[1]:
            raise DivergedRank(f"rank {group.rank} sampled other tokens than rank 0 in step {answered[0]}")
        if batch is None or os.getppid() != parent:
            return
        launch = getattr(executor, "launch", None)
        try:
            out = executor.execute(batch) if launch is None else executor.finish(launch(batch))
        except StepBatchError:  # refused by the step's checks, before any collective, as on rank 0: go on
            log.exception("step_failed", rank=group.rank, step_id=batch.step_id)
            continue
        except Exception:  # noqa: BLE001 - past the checks, its collectives no longer pair with rank 0's
            log.exception("expert_parallel_step_failed", rank=group.rank, step_id=batch.step_id)
            os._exit(FOLLOWER_FAILED_EXIT)
        sampled[out.step_id] = tokens_of(out)
        while len(sampled) > 4:  # rank 0 answers within two steps: older ones were checked or never will be
            sampled.pop(next(iter(sampled)))


def tokens_of(output) -> bytes:
    """A step's sampled tokens, as the ranks compare them."""
    return output.token_ids.astype("int32").tobytes()


class FollowerWatch(threading.Thread):
    """Rank 0: calls `on_failure(reason)` once when a follower's process ends."""

    def __init__(self, group: RankGroup, on_failure, interval_s: float = 0.2):
        super().__init__(name="expert-rank-watch", daemon=True)
        self.group, self.on_failure, self.interval_s = group, on_failure, interval_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            reason = failed_follower(self.group)
            if reason is not None:
                self.on_failure(reason)
                return
