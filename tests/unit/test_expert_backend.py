"""--expert-backend and --host-expert-threads (plan/expert_backend.py): the choice `ferry plan` shows and
the worker boots with, and the flags' errors."""

from __future__ import annotations

import json

import pytest

from ferry.plan.expert_backend import (
    chosen_host_cpus,
    core_map,
    format_cpu_list,
    host_thread_cpus,
    parse_cpu_list,
    physical_cores,
    plan_expert_backend,
    pool_thread_cpus,
)
from ferry.shared.errors import ConfigError


def test_auto_is_hybrid_on_the_cores_the_processes_leave_where_there_are_enough():
    got = plan_expert_backend(None, None, offloaded=True, cores=16)
    assert (got.backend, got.host_threads, got.requested) == ("hybrid", 12, "auto")
    assert "16 physical cores - 4" in got.reason
    got = plan_expert_backend(None, None, offloaded=True, cores=7)  # 3 threads to spare: the GPU alone
    assert (got.backend, got.host_threads) == ("gpu", 0)
    assert "fewer than 4" in got.reason and "--host-expert-threads" in got.reason  # and how to turn it on
    assert plan_expert_backend(None, None, offloaded=True, cores=8).host_threads == 4
    got = plan_expert_backend("auto", 2, offloaded=True, cores=2)  # threads given: a host share on as many
    assert (got.backend, got.host_threads) == ("hybrid", 2)
    got = plan_expert_backend("hybrid", None, offloaded=True, cores=2)  # asked for: at least one thread
    assert (got.backend, got.host_threads) == ("hybrid", 1)


def test_auto_shares_decode_layers_only_and_hybrid_asked_for_shares_prefills_too():
    """Auto's hybrid leaves prefills to the GPU: the prefill share lengthened the hybrid cut's steps at
    every size measured."""
    assert not plan_expert_backend(None, None, offloaded=True, cores=16).prefill_share
    assert not plan_expert_backend("auto", 6, offloaded=True, cores=16).prefill_share
    assert plan_expert_backend("hybrid", None, offloaded=True, cores=16).prefill_share
    assert plan_expert_backend("cpu", None, offloaded=True, cores=16).prefill_share
    assert not plan_expert_backend("gpu", None, offloaded=True, cores=16).prefill_share


def test_every_expert_resident_needs_no_host_whatever_was_asked():
    for backend in ("auto", "hybrid", "cpu"):
        got = plan_expert_backend(backend, None, offloaded=False, cores=16)
        assert (got.backend, got.host_threads, got.reason) == ("gpu", 0, "every expert has a GPU slot")


def test_explicit_backends_and_threads():
    assert plan_expert_backend("gpu", None, True, 16).backend == "gpu"
    got = plan_expert_backend("cpu", None, True, 2)  # asked for: at least one thread, however few cores
    assert (got.backend, got.host_threads) == ("cpu", 1)
    assert plan_expert_backend("hybrid", 6, True, 16).host_threads == 6


@pytest.mark.parametrize(
    "backend, threads, match",
    [
        ("tpu", None, "unknown --expert-backend 'tpu'"),
        ("hybrid", 0, "--host-expert-threads must be at least 1"),
        ("gpu", 4, "--host-expert-threads with --expert-backend gpu"),
    ],
)
def test_bad_flags_name_the_flag(backend, threads, match):
    with pytest.raises(ConfigError, match=match):
        plan_expert_backend(backend, threads, True, 16)


def test_physical_cores_counts_this_machine():
    import os

    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_ferry_plan_shows_the_backend_and_refuses_bad_flags(capsys, monkeypatch):
    from ferry.services.cli import main

    monkeypatch.setenv("FERRY_HOST_EXPERT_CPUS", "4-5")  # --host-expert-cpus, as every flag's variable

    model = "tests/data/models/qwen3-30b-a3b/config.json"
    base = ["plan", "--model", model, "--gpu-memory", "12GiB", "--host-memory", "100GiB"]
    assert main([*base, "--expert-backend", "hybrid", "--host-expert-threads", "12"]) == 0
    out = capsys.readouterr().out
    assert "expert backend hybrid (--expert-backend hybrid)" in out and "decode layers only" not in out
    # a list of two CPUs for 12 threads: the caller on the first, the workers on the rest (never beside it)
    assert (
        "12 host threads (--host-expert-threads 12), the decode hand-off's thread pinned to CPU 4, 11 workers to CPU 5"
    ) in out
    assert main([*base, "--host-expert-threads", "12"]) == 0
    assert "(auto: decode layers only, where they say it wins" in capsys.readouterr().out
    assert main([*base, "--json", "--expert-backend", "cpu", "--host-expert-threads", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_backend"] == {
        "backend": "cpu",
        "host_threads": 3,
        "reason": "--host-expert-threads 3",
        "requested": "cpu",
        "host_cpus": [4, 5],
    }
    assert main([*base, "--expert-backend", "gpu", "--host-expert-threads", "3"]) != 0
    assert "--host-expert-threads with --expert-backend gpu" in capsys.readouterr().err
    assert main([*base[:3], "--gpu-memory", "80GiB", "--moe-cache-rate", "1.0"]) == 0  # all resident: the GPU alone
    assert "expert backend gpu (--expert-backend auto)" in capsys.readouterr().out


def _cpuinfo(cores: list[tuple[int, int]]) -> str:
    """/proc/cpuinfo's text for logical CPUs 0.. on (physical id, core id) `cores`."""
    return "\n".join(
        f"processor\t: {cpu}\nphysical id\t: {phys}\ncore id\t\t: {core}\n" for cpu, (phys, core) in enumerate(cores)
    )


def test_the_pool_is_pinned_one_a_core_to_the_last_cores():
    # 8 cores with hyperthreads as Linux numbers them: CPU c and c + 8 share core c
    ht = _cpuinfo([(0, c) for c in range(8)] * 2)
    assert core_map(ht)[11] == ("0", "3")
    # 6 threads: the caller and 5 workers on the last 6 cores, never a sibling of another thread
    assert host_thread_cpus(6, list(range(16)), core_map(ht)) == [2, 3, 4, 5, 6, 7]
    # a cgroup that allows only some CPUs: chosen among those
    assert host_thread_cpus(3, [0, 1, 2, 8, 9, 10], core_map(ht)) == [0, 1, 2]
    # two sockets whose core ids repeat: (physical id, core id) tells their cores apart
    two = _cpuinfo([(0, 0), (0, 1), (1, 0), (1, 1)])
    assert host_thread_cpus(4, [0, 1, 2, 3], core_map(two)) == [0, 1, 2, 3]
    # more threads than cores: none pinned (two on a core would stall every call)
    assert host_thread_cpus(5, [0, 1, 2, 3], core_map(two)) == []
    assert host_thread_cpus(1, [0, 1, 2, 3], core_map(two)) == []  # a pool of one: the caller alone, never pinned
    # no topology (a container's masked cpuinfo): every allowed CPU is its own core
    assert host_thread_cpus(3, [4, 5, 6, 7], {}) == [5, 6, 7]


def test_the_pools_threads_take_the_cpus_in_order_the_caller_first():
    assert pool_thread_cpus(4, [5, 6, 7, 8]) == (5, [6, 7, 8])
    assert pool_thread_cpus(4, [5, 6, 7]) == (5, [6, 7, 6])  # round robin over the rest, never on the caller's
    assert pool_thread_cpus(3, [5]) == (5, [5, 5])  # one CPU for all: the list's choice
    assert pool_thread_cpus(1, [5]) == (5, [])
    assert pool_thread_cpus(4, []) == (None, [])


def test_the_pinning_setting_is_auto_none_or_a_cpu_list():
    info = _cpuinfo([(0, c) for c in range(16)])
    assert chosen_host_cpus(12, "auto", info, list(range(16))) == list(range(4, 16))
    assert chosen_host_cpus(12, None, info, list(range(16))) == list(range(4, 16))  # not given: auto
    assert chosen_host_cpus(12, "none", info, list(range(16))) == []
    assert chosen_host_cpus(12, " 4-6,9 ", info, list(range(16))) == [4, 5, 6, 9]
    for bad in ("4-x", "-1", ",", "five"):
        with pytest.raises(ConfigError, match="--host-expert-cpus"):
            chosen_host_cpus(12, bad, info, list(range(16)))
    assert parse_cpu_list("0-2,8") == [0, 1, 2, 8]
    assert format_cpu_list([0, 1, 2, 8, 10, 11]) == "0-2,8,10-11" and format_cpu_list([]) == ""


def test_a_bad_cpu_list_fails_the_plan_naming_the_flag(capsys):
    from ferry.services.cli import main

    model = "tests/data/models/qwen3-30b-a3b/config.json"
    for threads in ("3", "1"):  # whether or not a thread is started to pin
        assert (
            main(
                [
                    "plan",
                    "--model",
                    model,
                    "--gpu-memory",
                    "12GiB",
                    "--host-memory",
                    "100GiB",
                    "--host-expert-threads",
                    threads,
                    "--host-expert-cpus",
                    "4-x",
                ]
            )
            != 0
        )
        assert "--host-expert-cpus '4-x' is not a CPU list" in capsys.readouterr().err
