"""Host RAM for the offloaded experts: what the pinned banks take and what the machine has.

With fewer expert slots than experts every routed expert lives in host banks (pinned, so copies
run at full PCIe speed): one block per MoE layer and weight family, exactly 3 x I x H elements
per expert and nothing more (services/worker/offload/host_banks.py allocates them; a unit test
holds the two to the same bytes). The planner prices them here so that a plan whose banks cannot
fit fails in the plan, with the figures, rather than in an allocation."""

from __future__ import annotations

from pathlib import Path

from ferry.plan import pool_layout as L
from ferry.plan.model_config import ModelSpec
from ferry.shared.units import GiB

# Host memory the banks must leave to everything else (the worker, the page cache of a checkpoint
# being read, the OS): asking for the last byte of MemAvailable ends in the OOM killer. The worker's
# own check before it allocates the banks (services/worker/offload/host_banks.py) uses these too.
HOST_RESERVE_BYTES = 2 * GiB
MEMINFO = Path("/proc/meminfo")


def expert_bank_bytes(spec: ModelSpec, dtype: str) -> int:
    """Every routed expert of every MoE layer, in host banks."""
    return spec.total_experts * L.expert_bytes(spec, dtype)


def mem_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is no such file (not Linux)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                value, unit = line.split()[1:3]
                return int(value) * (1024 if unit.lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None
