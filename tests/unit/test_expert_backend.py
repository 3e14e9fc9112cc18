"""--expert-backend and --host-expert-threads (plan/expert_backend.py): the choice `ferry plan` shows and
the worker boots with, and the flags' errors."""

from __future__ import annotations

import json

import pytest

from ferry.plan.expert_backend import physical_cores, plan_expert_backend
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
    """Auto's hybrid leaves prefills to the GPU: on the H200 the prefill share lengthened the hybrid cut's
    steps at every size measured (bench/NOTES.md, issue 23)."""
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


@pytest.mark.parametrize("backend, threads, match", [("tpu", None, "unknown --expert-backend 'tpu'"),
                                                     ("hybrid", 0, "--host-expert-threads must be at least 1"),
                                                     ("gpu", 4, "--host-expert-threads with --expert-backend gpu")])  # fmt: skip
def test_bad_flags_name_the_flag(backend, threads, match):
    with pytest.raises(ConfigError, match=match):
        plan_expert_backend(backend, threads, True, 16)


def test_physical_cores_counts_this_machine():
    import os

    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_ferry_plan_shows_the_backend_and_refuses_bad_flags(capsys):
    from ferry.services.cli import main

    model = "tests/data/models/qwen3-30b-a3b/config.json"
    base = ["plan", "--model", model, "--gpu-memory", "12GiB", "--host-memory", "100GiB"]
    assert main([*base, "--expert-backend", "hybrid", "--host-expert-threads", "12"]) == 0
    out = capsys.readouterr().out
    assert "expert backend hybrid (--expert-backend hybrid)" in out and "decode layers only" not in out
    assert main([*base, "--host-expert-threads", "12"]) == 0
    assert "(auto: decode layers only, where they say it wins" in capsys.readouterr().out
    assert main([*base, "--json", "--expert-backend", "cpu", "--host-expert-threads", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["expert_backend"] == {"backend": "cpu", "host_threads": 3,
                                                                     "reason": "--host-expert-threads 3",
                                                                     "requested": "cpu"}  # fmt: skip
    assert main([*base, "--expert-backend", "gpu", "--host-expert-threads", "3"]) != 0
    assert "--host-expert-threads with --expert-backend gpu" in capsys.readouterr().err
    assert main([*base[:3], "--gpu-memory", "80GiB", "--moe-cache-rate", "1.0"]) == 0  # all resident: the GPU alone
    assert "expert backend gpu (--expert-backend auto)" in capsys.readouterr().out
