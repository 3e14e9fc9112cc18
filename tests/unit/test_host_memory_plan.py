"""Host RAM in the plan: the pinned expert banks are priced by the same bytes the worker allocates,
and an offload plan whose banks do not fit what the host has is a plan error, before any pool."""

from __future__ import annotations

import pytest

from ferry.plan import host_memory
from ferry.plan.model_config import load_model_config
from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.plan.store_plan import plan_for_expert_store
from ferry.shared.errors import PlanError
from ferry.shared.units import GiB, MiB


@pytest.fixture(scope="module")
def spec(tiny_models):
    return load_model_config(tiny_models["qwen3_moe"])


def test_planned_bank_bytes_are_what_the_worker_allocates(spec):
    from ferry.services.worker.offload.host_memory import host_banks

    banks = host_banks.HostBanks.for_model(spec, "float32", pin=False, progress=False)
    assert host_memory.expert_bank_bytes(spec, "float32") == banks.nbytes
    assert host_memory.HOST_RESERVE_BYTES == host_banks.HOST_RESERVE_BYTES  # one figure for both checks


def test_offloaded_plan_reports_and_checks_the_banks(spec):
    req = PlanRequest(gpu_memory=64 * MiB, moe_cache_size=spec.num_experts, max_model_len=256)
    banks = host_memory.expert_bank_bytes(spec, "float32")
    plan = make_plan(spec, req, Measured(10**6, 10**6, host_available_bytes=4 * GiB))
    assert plan.experts.slots < plan.experts.total
    assert (plan.host.expert_bank_bytes, plan.host.available_bytes, plan.host.available_source) == (
        banks,
        4 * GiB,
        "MemAvailable",
    )
    with pytest.raises(PlanError, match="do not fit in host RAM") as err:
        plan_for_expert_store(spec, req, Measured(10**6, 10**6, host_available_bytes=2 * GiB + banks - 1))
    assert "--host-memory" in str(err.value)
    ok = plan_for_expert_store(spec, req, Measured(10**6, 10**6, host_available_bytes=2 * GiB + banks))
    assert ok.host.expert_bank_bytes == banks
    # --host-memory wins over what the machine has; unknown RAM (no /proc/meminfo) is not checked
    with pytest.raises(PlanError, match="--host-memory 1.00 MiB"):
        make_plan(
            spec,
            PlanRequest(**{**req.__dict__, "host_memory": MiB}),
            Measured(10**6, 10**6, host_available_bytes=8 * GiB),
        )
    unknown = make_plan(spec, req, Measured(10**6, 10**6))
    assert unknown.host.available_bytes is None and unknown.host.available_source == "unknown"


def test_all_resident_plan_needs_no_banks(spec):
    plan = make_plan(
        spec, PlanRequest(gpu_memory=GiB, max_model_len=256), Measured(10**6, 10**6, host_available_bytes=1)
    )
    assert plan.experts.slots == plan.experts.total and plan.host.expert_bank_bytes == 0


def test_mem_available_reads_proc_meminfo(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       99999999 kB\nMemAvailable:   2048 kB\n")
    assert host_memory.mem_available_bytes(path) == 2048 * 1024
    assert host_memory.mem_available_bytes(tmp_path / "missing") is None
