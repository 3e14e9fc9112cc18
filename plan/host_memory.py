"""Host RAM for the offloaded experts: what the pinned banks take and what the machine has.

With fewer expert slots than experts every routed expert lives in host banks (pinned, so copies
run at full PCIe speed): one block per MoE layer and weight family, exactly 3 x I x H elements
per expert and nothing more (services/worker/offload/host_memory/host_banks.py allocates them; a unit test
holds the two to the same bytes). The planner prices them here so that a plan whose banks cannot
fit fails in the plan, with the figures, rather than in an allocation."""

from __future__ import annotations

from pathlib import Path

from ferry.plan import expert_formats as F
from ferry.plan.dtypes import DTYPE_BYTES
from ferry.plan.model_config import ModelSpec
from ferry.shared.units import GiB

# Host memory the banks must leave to everything else (the worker, the page cache of a checkpoint
# being read, the OS): asking for the last byte of MemAvailable ends in the OOM killer. The worker's
# own check before it allocates the banks (services/worker/offload/host_memory/host_banks.py) uses these too.
HOST_RESERVE_BYTES = 2 * GiB
MEMINFO = Path("/proc/meminfo")


# Expert bank formats (--expert-bank-format): auto, or a format's word for its banks
# (plan/expert_formats): `packed` keeps bf16 experts losslessly in 12 bits a value (bf16-packed),
# `plain` as the slots hold them. "auto" is each slot format's own choice (packed for bf16).
BANK_FORMATS = F.bank_words()


def bank_format(requested: str | None, dtype: str, slot_format: str | None = None, biases: bool = False) -> str:
    """The banks' --expert-bank-format word for the flag's value (None: auto), the model's dtype, what
    its slots hold (a format's name, None: unquantized: quantized experts are kept as their slots hold them)
    and whether the experts have biases (ModelSpec.expert_bias)."""
    requested = requested or F.AUTO_BANKS
    if requested not in BANK_FORMATS:
        raise ValueError(f"--expert-bank-format: unknown format {requested!r}; choose one of {', '.join(BANK_FORMATS)}")
    slots = F.get(slot_format) if slot_format else F.unquantized()
    return slots.banks_for(requested, dtype, biases).bank_word


def expert_bank_bytes(spec: ModelSpec, dtype: str, fmt: str = F.PLAIN_BANKS) -> int:
    """Every routed expert of every MoE layer, in host banks of --expert-bank-format word `fmt`."""
    return F.banks_format(spec, fmt, dtype).bank_bytes(spec, DTYPE_BYTES[dtype])


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
