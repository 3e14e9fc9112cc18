"""`ferry plan --gpus N` (plan/expert_parallel.py, issue 26): a plan for every GPU of an expert-parallel
worker, without GPUs: each GPU's own experts, the replicated dense part, NCCL's buffers priced, and the
banks of all GPUs held to the one host's RAM."""

from __future__ import annotations

import json

import pytest

from ferry.plan.expert_parallel import NCCL_BUFFSIZE, nccl_workspace_bytes, owned_experts
from ferry.services.cli import main

MODEL = "tests/data/models/qwen3-30b-a3b/config.json"
BASE = ["plan", "--model", MODEL, "--gpu-memory", "12GiB", "--host-memory", "100GiB", "--json"]


def plan_json(capsys, *flags) -> dict:
    assert main([*BASE, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_gpu_plans_its_own_experts_beside_the_replicated_rest(capsys):
    one = plan_json(capsys)
    two = plan_json(capsys, "--gpus", "2")
    assert two["expert_parallel_size"] == 2 and len(two["gpus"]) == 2
    layers = one["experts"]["total"] // 128
    for g, p in enumerate(two["gpus"]):
        assert p["experts"]["total"] == layers * owned_experts(128, g, 2) == layers * 64
        assert p["weights_bytes"] == one["weights_bytes"]  # the dense weights are replicated
        assert p["workspace_bytes"] >= nccl_workspace_bytes(2) and "NCCL" in p["workspace_source"]
        assert p["total_bytes"] <= p["budget_bytes"] == one["budget_bytes"]  # --gpu-memory is per GPU
        # half the banks each: together what one GPU pins (to the packed banks' rounding of their escape room)
        assert abs(p["host"]["expert_bank_bytes"] * 2 - one["host"]["expert_bank_bytes"]) < 4096
    assert plan_json(capsys, "--gpus", "1") == one  # one GPU: today's plan


def test_three_gpus_split_the_experts_unevenly_where_they_must():
    assert [owned_experts(128, g, 3) for g in range(3)] == [43, 43, 42]
    assert nccl_workspace_bytes(1) == 0 and nccl_workspace_bytes(3) == 2 * 2 * 32 * NCCL_BUFFSIZE


def test_the_gpus_banks_together_must_fit_the_host(capsys):
    flags = [a for a in BASE if a != "100GiB"]
    flags[flags.index("--host-memory") + 1 : flags.index("--host-memory") + 1] = ["30GiB"]
    assert main([*flags, "--gpus", "2"]) != 0
    err = capsys.readouterr().err
    assert "the 2 GPUs' expert banks do not fit in host RAM" in err and "--host-memory" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor-parallel-size", "2"], "add --enable-expert-parallel"),
        (["--tensor-parallel-size", "2", "--expert-parallel-size", "4"], "disagree"),
        (["--gpus", "0"], "at least 1"),
        (["--gpus", "256"], "exceeds the model's 128 experts"),
    ],
)
def test_flag_combinations_ferry_does_not_run_name_the_flag(capsys, flags, message):
    assert main([*BASE, *flags]) != 0
    assert message in capsys.readouterr().err


def test_vllms_spelling_plans_the_same(capsys):
    assert plan_json(capsys, "--tensor-parallel-size", "2", "--enable-expert-parallel") == plan_json(
        capsys, "--gpus", "2"
    )


def test_the_table_names_each_gpu(capsys):
    assert main([a for a in BASE if a != "--json"] + ["--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0 of 2: experts e % 2 == 0, 64 of 128" in out and "GPU 1 of 2" in out
    assert "the 2 GPUs' banks together pin" in out


def test_each_ranks_process_keeps_its_own_reserve_beside_the_banks(capsys):
    """Every rank is a process of its own (its interpreter, CUDA context, buffers): the banks of two GPUs and two
    reserves must fit, where one GPU's host holds the same banks with one."""
    from ferry.plan.expert_parallel import check_ranks_host
    from ferry.plan.host_memory import HOST_RESERVE_BYTES
    from ferry.shared.errors import PlanError

    banks = plan_json(capsys)["host"]["expert_bank_bytes"]
    room = banks + HOST_RESERVE_BYTES * 3 // 2  # one reserve fits, two do not
    flags = [a for a in BASE if a != "100GiB"]
    flags[flags.index("--host-memory") + 1 : flags.index("--host-memory") + 1] = [f"{room}B"]
    assert main(flags) == 0
    capsys.readouterr()
    assert main([*flags, "--gpus", "2"]) != 0
    assert "kept for each of the 2 rank processes" in capsys.readouterr().err
    with pytest.raises(PlanError, match="--expert-parallel-size"):
        check_ranks_host([banks // 2, banks // 2], HOST_RESERVE_BYTES, room, "MemAvailable")
    check_ranks_host([banks // 2, banks // 2], HOST_RESERVE_BYTES, None, "unknown")  # nothing known: no check


def test_without_host_memory_a_plan_for_another_machine_marks_the_host_not_checked(capsys, monkeypatch):
    """`--gpu-memory` without `--host-memory` plans for any machine (docs/ARCHITECTURE.md §2): banks this one
    cannot hold are "not checked", as in the one-GPU plan, not a failure (README's `--gpus 2` example failed on
    a 24 GiB host); with --host-memory they are checked."""
    from ferry.plan import plan_command

    monkeypatch.setattr(plan_command, "mem_available_bytes", lambda: 24 * 2**30)
    flags = ["plan", MODEL, "--gpu-memory", "12GiB", "--gpus", "2"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "not checked" in out and "this machine has 24.00 GiB" in out and "--host-memory" in out, out
    assert main([*flags, "--json"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert all(p["host"]["available_source"] == "not checked" and p["host"]["available_bytes"] is None for p in gpus)
    assert main([*flags, "--host-memory", "24GiB"]) == 2  # given: checked, and they do not fit
    assert "do not fit in host RAM" in capsys.readouterr().err
    monkeypatch.setattr(plan_command, "mem_available_bytes", lambda: 512 * 2**30)  # fits here: checked, and said
    assert main([*flags, "--json"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert all(p["host"]["available_source"] == "MemAvailable" for p in gpus)
