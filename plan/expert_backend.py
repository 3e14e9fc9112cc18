"""Who computes the experts a step misses: the GPU after a PCIe copy, the host where they lie, or both.

`--expert-backend` (issue 25):

* `gpu`: every missed expert crosses PCIe and the GPU computes it (the host computes nothing);
* `hybrid`: the host computes part of each layer's misses while the rest cross, the split decided per
  layer by costs the worker measures at boot (services/worker/offload/host_share.py, host_decode.py);
* `cpu`: the host computes every missed expert (what is resident in GPU slots stays on the GPU);
* `auto` (default): `hybrid` on the threads the machine can spare, if it can spare AUTO_MIN_THREADS, and
  the worker keeps the decode share only where its calibration says the host shortens a decode layer;
  the GPU alone otherwise. With `--host-expert-threads N` it is hybrid on N threads. Auto's hybrid has
  no prefill share (`prefill_share`): on the H200 it made the hybrid cut's prefill steps slower at every
  size measured (1.2-1.3x at 1,200 tokens, 2.7-3.3x at 8,192; bench/NOTES.md, issue 23); `hybrid` asked
  for keeps it, within the sizes its costs were measured at.

The host's threads: `--host-expert-threads N`, default the physical cores minus RESERVED_CORES (the three
processes' threads and one for the rest of the machine). Nothing here imports torch: `ferry plan` shows the choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ferry.shared.errors import ConfigError

EXPERT_BACKENDS = ("auto", "gpu", "hybrid", "cpu")
# the api, the scheduler, the worker's launching thread, and one for the rest of the machine (a client on
# it, the driver's threads): on the H200's 16 cores the 12-layer Qwen3-30B cut ran 1.42x GPU-only with 12
# host threads against 1.35x with 13 (bench/NOTES.md)
RESERVED_CORES = 4
# fewer threads than this and auto keeps the GPU alone: the host's pool spins while it waits for work, and
# on a machine of few cores it would take time the three processes need; unmeasured below 12 threads
AUTO_MIN_THREADS = 4


@dataclass(frozen=True)
class ExpertBackendPlan:
    backend: str = "gpu"  # gpu | hybrid | cpu
    host_threads: int = 0
    reason: str = "every expert has a GPU slot"
    requested: str = "auto"

    @property
    def prefill_share(self) -> bool:
        """Whether the host computes part of streamed prefills' misses too (services/worker/offload/
        host_share.py): asked for with hybrid or cpu, not chosen by auto (module docstring)."""
        return self.backend == "cpu" or (self.backend == "hybrid" and self.requested != "auto")


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
    spare = cores - RESERVED_CORES
    if requested == "auto" and spare < AUTO_MIN_THREADS:
        return ExpertBackendPlan("gpu", 0, f"auto: {cores} physical cores leave fewer than {AUTO_MIN_THREADS} for "
                                           "the host's share (--host-expert-threads N turns it on)", requested)  # fmt: skip
    return ExpertBackendPlan("hybrid" if requested == "auto" else requested, max(1, spare),
                             f"{cores} physical cores - {RESERVED_CORES} for the processes", requested)  # fmt: skip
