"""Who computes the experts a step misses: the GPU after a PCIe copy, the host where they lie, or both.

`--expert-backend`:

* `gpu`: every missed expert crosses PCIe and the GPU computes it (the host computes nothing);
* `hybrid`: the host computes part of each layer's misses while the rest cross, the split decided per
  layer by costs the worker measures at boot (services/worker/offload/host_compute/prefill_share.py,
  decode_share.py);
* `cpu`: the host computes every missed expert (what is resident in GPU slots stays on the GPU);
* `auto` (default): `hybrid` on the threads the machine can spare, if it can spare AUTO_MIN_THREADS, and
  the worker keeps the decode share only where its calibration says the host shortens a decode layer;
  the GPU alone otherwise. With `--host-expert-threads N` it is hybrid on N threads. Auto's hybrid has
  no prefill share (`prefill_share`): it made the hybrid cut's prefill steps slower at every size
  measured (1.2-1.3x at 1,200 tokens, 2.7-3.3x at 8,192); `hybrid` asked
  for keeps it, within the sizes its costs were measured at.

The host's threads: `--host-expert-threads N`, default the physical cores minus RESERVED_CORES (the three
processes' threads and one for the rest of the machine), pinned one a physical core to the last cores,
the pool's caller (the thread that runs a decode graph's host nodes) on the first of them
(`--host-expert-cpus auto|none|LIST`; chosen_host_cpus). Nothing here imports torch: `ferry plan` shows the choice.
The worker wires the choice at boot, one object a kind: services/worker/offload/host_compute/expert_backends.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ferry.plan.model_spec import CLAMPED_SWIGLU, GELU_TANH, SILU

if TYPE_CHECKING:
    from ferry.plan.model_spec import ModelSpec

from ferry.shared.errors import ConfigError

EXPERT_BACKENDS = ("auto", "gpu", "hybrid", "cpu")
# the api, the scheduler, the worker's launching thread, and one for the rest of the machine (a client on
# it, the driver's threads): on a 16-core host the 12-layer Qwen3-30B cut ran 1.42x GPU-only with 12
# host threads against 1.35x with 13
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
    host_cpus: tuple[int, ...] = ()  # the host pool's threads' CPUs, the caller's first (chosen_host_cpus)

    @property
    def prefill_share(self) -> bool:
        """Whether the host computes part of streamed prefills' misses too (services/worker/offload/
        offload/host_compute/prefill_share.py): asked for with hybrid or cpu, not chosen by auto (module docstring)."""
        return self.backend == "cpu" or (self.backend == "hybrid" and self.requested != "auto")


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthreads counted once), from /proc/cpuinfo's
    (physical id, core id) pairs; the affinity count where those are not given."""
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        cores = set(core_map(Path("/proc/cpuinfo").read_text()).values())
    except OSError:
        return logical
    return min(logical, len(cores)) if cores else logical


def check_expert_backend_flags(requested: str | None, threads: int | None) -> str:
    """The backend asked for (auto when None), or ConfigError naming the flag to change."""
    requested = requested or "auto"
    if requested not in EXPERT_BACKENDS:
        raise ConfigError(f"unknown --expert-backend {requested!r}: choose one of {', '.join(EXPERT_BACKENDS)}")
    if threads is not None and threads < 1:
        raise ConfigError(
            f"--host-expert-threads must be at least 1, got {threads} (--expert-backend gpu turns the host's share off)"
        )
    if requested == "gpu" and threads is not None:
        raise ConfigError("--host-expert-threads with --expert-backend gpu: the GPU computes every expert; drop one")
    return requested


# the activations the host's expert kernels (kernels/host_experts_c/ and their torch twin) compute, with or without
# the experts' biases
HOST_ACTIVATIONS = (SILU, CLAMPED_SWIGLU, GELU_TANH)


def host_compute_refusal(spec: ModelSpec) -> str | None:
    """Why the host cannot compute this model's experts, or None: any activation but HOST_ACTIVATIONS is the
    GPU's alone."""
    if spec.expert_activation not in HOST_ACTIVATIONS:
        return f"the host's expert kernels compute {' and '.join(HOST_ACTIVATIONS)} experts, not {spec.arch}'s " + (
            f"{spec.expert_activation} ones"
        )
    return None


def plan_expert_backend(
    requested: str | None, threads: int | None, offloaded: bool, cores: int, host_refusal: str | None = None
) -> ExpertBackendPlan:
    """The backend and host threads for flags `requested` (--expert-backend, None: auto) and `threads`
    (--host-expert-threads, None: the default), with `cores` physical cores, or ConfigError naming the flag.
    `host_refusal` (host_compute_refusal): the host cannot compute this model's experts, so auto keeps the
    GPU alone and hybrid, cpu or --host-expert-threads are refused with it."""
    requested = check_expert_backend_flags(requested, threads)
    if not offloaded:
        return ExpertBackendPlan("gpu", 0, "every expert has a GPU slot", requested)
    if requested == "gpu":
        return ExpertBackendPlan("gpu", 0, "--expert-backend gpu", requested)
    if host_refusal is not None:
        if requested != "auto" or threads is not None:
            flag = f"--expert-backend {requested}" if requested != "auto" else "--host-expert-threads"
            raise ConfigError(f"{flag}: {host_refusal}; use --expert-backend gpu (or auto)")
        return ExpertBackendPlan("gpu", 0, f"auto: {host_refusal}", requested)
    if threads is not None:
        return ExpertBackendPlan(
            "hybrid" if requested == "auto" else requested, threads, f"--host-expert-threads {threads}", requested
        )
    spare = cores - RESERVED_CORES
    if requested == "auto" and spare < AUTO_MIN_THREADS:
        return ExpertBackendPlan(
            "gpu",
            0,
            f"auto: {cores} physical cores leave fewer than {AUTO_MIN_THREADS} for "
            "the host's share (--host-expert-threads N turns it on)",
            requested,
        )
    return ExpertBackendPlan(
        "hybrid" if requested == "auto" else requested,
        max(1, spare),
        f"{cores} physical cores - {RESERVED_CORES} for the processes",
        requested,
    )


def core_map(cpuinfo: str) -> dict[int, tuple[str, str]]:
    """Each logical CPU's (physical id, core id) from /proc/cpuinfo's text; {} where it gives none."""
    cores, cpu, phys = {}, None, "0"
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            cpu, phys = int(value), "0"
        elif key == "physical id":
            phys = value
        elif key == "core id" and cpu is not None:
            cores[cpu] = (phys, value)
    return cores


def host_thread_cpus(threads: int, allowed: list[int], cores: dict[int, tuple[str, str]]) -> list[int]:
    """The CPUs of the host pool's `threads` threads, the caller's first (thread_pool.c: the CUDA driver's
    thread that runs a decode graph's host nodes, or the polling thread, takes it), then its `threads - 1`
    started workers': one logical CPU a physical core, a hyperthread's sibling never beside a thread, taken
    from the last cores of `allowed`. The first cores are left to the three processes and the rest of the
    machine, which the kernel's scheduler places there (none are left where the threads take every core:
    --host-expert-threads as many as the cores). None where there are fewer cores than threads (or a pool
    of one thread, which starts none): two threads on one core would stall each call."""
    if threads < 2:
        return []
    first_of_core: dict[tuple[str, str], int] = {}
    for cpu in sorted(allowed):
        first_of_core.setdefault(cores.get(cpu, ("cpu", str(cpu))), cpu)
    firsts = sorted(first_of_core.values())
    if threads > len(firsts):
        return []
    return firsts[len(firsts) - threads :]


def parse_cpu_list(text: str) -> list[int]:
    """A CPU list as taskset and cgroups write it ("0-3,8,10-11"), or ConfigError naming --host-expert-cpus."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ConfigError(
            f"--host-expert-cpus {text!r} is not a CPU list (auto, none, or like 4-15 or 4,6,8-11)"
        ) from None
    if not cpus or min(cpus) < 0:
        raise ConfigError(f"--host-expert-cpus {text!r} names no CPU (auto, none, or like 4-15 or 4,6,8-11)")
    return cpus


def chosen_host_cpus(
    threads: int, setting: str | None = None, cpuinfo: str | None = None, allowed: list[int] | None = None
) -> list[int]:
    """The CPUs of the host pool's threads, the caller's first, by --host-expert-cpus `setting` (None: auto):
    auto picks them (host_thread_cpus), none pins nothing, a list is taken as given (the caller on its first
    CPU, the workers round robin over the rest where it is shorter: pool_thread_cpus)."""
    setting = (setting or "").strip() or "auto"
    if setting == "none":
        return []
    if setting != "auto":
        return parse_cpu_list(setting)
    if allowed is None:
        allowed = (
            sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        )
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    return host_thread_cpus(threads, allowed, core_map(cpuinfo))


def pool_thread_cpus(threads: int, cpus) -> tuple[int | None, list[int]]:
    """(the caller's CPU, the started workers' CPUs) of a pool of `threads` over `cpus` as thread_pool.c
    places them: the caller on the first, the workers round robin over the rest (over the first if it is
    the only one); (None, []) without CPUs."""
    cpus = list(cpus)
    if not cpus:
        return None, []
    rest = cpus[1:] or cpus
    return cpus[0], [rest[(i - 1) % len(rest)] for i in range(1, threads)]


def format_cpu_list(cpus) -> str:
    """CPUs as a list of ranges ("5-15", "0,2,4-6"), the form --host-expert-cpus takes; "" for none."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)
