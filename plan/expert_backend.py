"""Who computes the experts a step misses: the GPU after a PCIe copy, the host where they lie, or both.

`--expert-backend` (issue 25):

* `gpu`: every missed expert crosses PCIe and the GPU computes it (the host computes nothing);
* `hybrid`: the host computes part of each layer's misses while the rest cross, the split decided per
  layer by costs the worker measures at boot (services/worker/offload/host_share.py, host_decode.py);
* `cpu`: the host computes every missed expert (what is resident in GPU slots stays on the GPU);
* `auto` (default): the GPU alone, for now (AUTO_GPU_REASON says why); with `--host-expert-threads N` it
  is hybrid on N threads, and the worker keeps the decode share only where its calibration says the host
  shortens a decode layer.

The host's threads: `--host-expert-threads N`, default the physical cores minus RESERVED_CORES (the api,
the scheduler and the worker's own thread). Nothing here imports torch: `ferry plan` shows the choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ferry.shared.errors import ConfigError

EXPERT_BACKENDS = ("auto", "gpu", "hybrid", "cpu")
RESERVED_CORES = 3  # the api, the scheduler, the worker's launching thread
# Measured on the H200 (bench/NOTES.md, "The host's share of decode layers with the prefetch"): the host's
# share (auto, 13 threads) made the 12-layer Qwen3-30B cut 1.35x faster at one stream and 1.75x at eight,
# but the full-size Qwen3-30B served 13.3 tok/s at one stream against 20-23 on the GPU alone, which the
# boot calibration did not foresee.
AUTO_GPU_REASON = ("auto: the GPU alone until the host's share is measured to win at full size "
                   "(--expert-backend hybrid turns it on)")  # fmt: skip


@dataclass(frozen=True)
class ExpertBackendPlan:
    backend: str = "gpu"  # gpu | hybrid | cpu
    host_threads: int = 0
    reason: str = "every expert has a GPU slot"
    requested: str = "auto"


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthreads counted once), from /proc/cpuinfo's
    (physical id, core id) pairs; the affinity count where those are not given."""
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return logical
    cores, phys = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = value.strip()
        elif key == "core id":
            cores.add((phys, value.strip()))
    return min(logical, len(cores)) if cores else logical


def check_expert_backend_flags(requested: str | None, threads: int | None) -> str:
    """The backend asked for (auto when None), or ConfigError naming the flag to change."""
    requested = requested or "auto"
    if requested not in EXPERT_BACKENDS:
        raise ConfigError(f"unknown --expert-backend {requested!r}: choose one of {', '.join(EXPERT_BACKENDS)}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--host-expert-threads must be at least 1, got {threads} (--expert-backend gpu turns the "
                          "host's share off)")  # fmt: skip
    if requested == "gpu" and threads is not None:
        raise ConfigError("--host-expert-threads with --expert-backend gpu: the GPU computes every expert; drop one")
    return requested


def plan_expert_backend(requested: str | None, threads: int | None, offloaded: bool, cores: int) -> ExpertBackendPlan:
    """The backend and host threads for flags `requested` (--expert-backend, None: auto) and `threads`
    (--host-expert-threads, None: the default), with `cores` physical cores, or ConfigError naming the flag."""
    requested = check_expert_backend_flags(requested, threads)
    if not offloaded:
        return ExpertBackendPlan("gpu", 0, "every expert has a GPU slot", requested)
    if requested == "gpu":
        return ExpertBackendPlan("gpu", 0, "--expert-backend gpu", requested)
    if threads is not None:
        return ExpertBackendPlan("hybrid" if requested == "auto" else requested, threads,
                                 f"--host-expert-threads {threads}", requested)  # fmt: skip
    if requested == "auto":
        return ExpertBackendPlan("gpu", 0, AUTO_GPU_REASON, requested)
    return ExpertBackendPlan(requested, max(1, cores - RESERVED_CORES),
                             f"{cores} physical cores - {RESERVED_CORES} for the processes", requested)  # fmt: skip
