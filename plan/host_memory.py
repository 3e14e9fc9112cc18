"""Host RAM for the offloaded experts: what the pinned banks take and what the machine has.

With fewer expert slots than experts every routed expert lives in host banks (pinned, so copies
run at full PCIe speed): one block per MoE layer and weight family, exactly 3 x I x H elements
per expert and nothing more (services/worker/offload/host_memory/host_banks.py allocates them; a unit test
holds the two to the same bytes). The planner prices them here so that a plan whose banks cannot
fit fails in the plan, with the figures, rather than in an allocation."""

from __future__ import annotations

from pathlib import Path

from ferry.plan import pool_layout as L
from ferry.plan.model_config import ModelSpec
from ferry.shared.units import GiB

# Host memory the banks must leave to everything else (the worker, the page cache of a checkpoint
# being read, the OS): asking for the last byte of MemAvailable ends in the OOM killer. The worker's
# own check before it allocates the banks (services/worker/offload/host_memory/host_banks.py) uses these too.
HOST_RESERVE_BYTES = 2 * GiB
MEMINFO = Path("/proc/meminfo")


# Expert bank formats (--expert-bank-format): "packed" keeps bf16 experts losslessly in 12 bits a
# value (kernels/expert_pack.py: a quarter fewer bytes in RAM and on the wire), "plain" as the slots
# hold them. Packing applies to bf16 only; "auto" packs exactly then.
BANK_FORMATS = ("auto", "packed", "plain")
# A packed expert's values outside its exponent window are kept whole, 6 bytes each (int32 position,
# int16 bits). Normal and trained weights have about 1e-4 of them; the plan sets aside room for
# 1/512 of the values (0.8% of the packed bytes), and the banks check what they really hold.
PACKED_ESCAPE_BYTES = 6
PACKED_ESCAPE_SHARE = 512


def bank_format(requested: str | None, dtype: str, slot_format: str = "bf16") -> str:
    """ "packed" or "plain" for the flag's value (None: auto), the model's dtype and what its slots
    hold (plan/expert_formats.py): quantized experts are kept in the banks as their slots hold them."""
    requested = requested or "auto"
    if requested not in BANK_FORMATS:
        raise ValueError(f"--expert-bank-format: unknown format {requested!r}; choose one of {', '.join(BANK_FORMATS)}")
    if slot_format != "bf16":
        if requested == "packed":
            raise ValueError(
                f"--expert-bank-format packed keeps bf16 experts; this checkpoint's experts are "
                f"{slot_format}, kept as they are: use --expert-bank-format auto (or plain)"
            )
        return "plain"
    if requested == "packed" and dtype != "bfloat16":
        raise ValueError(
            f"--expert-bank-format packed keeps bf16 experts; this model runs in {dtype}: "
            "use --expert-bank-format plain (or auto), or --dtype bfloat16"
        )
    return "packed" if requested == "packed" or (requested == "auto" and dtype == "bfloat16") else "plain"


def packed_expert_bytes(values: int) -> int:
    """One packed expert of `values` values (3 I H) without its escapes: a byte (sign, mantissa)
    and half a byte (exponent code) per value, and two int32 exponent bases (one per family)."""
    return values + values // 2 + 2 * 4


def packed_escape_allowance(values: int) -> int:
    """The escaped values the plan prices for one packed expert of `values` values."""
    return values // PACKED_ESCAPE_SHARE


def packed_bank_bytes(num_layers: int, num_experts: int, values: int) -> int:
    """Packed banks of experts of `values` values: the fixed part, the escape allowance, and each
    layer's escape offsets (int64, one per expert and one more)."""
    allowance = packed_escape_allowance(values) * PACKED_ESCAPE_BYTES
    return num_layers * (num_experts * (packed_expert_bytes(values) + allowance) + (num_experts + 1) * 8)


def expert_bank_bytes(spec: ModelSpec, dtype: str, fmt: str = "plain") -> int:
    """Every routed expert of every MoE layer, in host banks of format `fmt`."""
    if fmt == "packed":
        values = 3 * spec.moe_intermediate_size * spec.hidden_size
        return packed_bank_bytes(len(spec.moe_layer_indices), spec.num_experts, values)
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
