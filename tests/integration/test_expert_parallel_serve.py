"""Issue 26 on CPU: `ferry worker --expert-parallel-size 2` as served, one process a rank over gloo (rank 0
starts rank 1: services/worker/expert_ranks.py). Through real processes and the OpenAI client: greedy and
seeded completions equal one rank's, unseeded sampling stays in step on both ranks (rank 1 checks every
step's tokens against rank 0's), and a rank that dies fails the requests in flight naming it and brings
/health to 503, as a dead worker does."""

from __future__ import annotations

import json
import os
import signal
import time

import openai
import pytest

from tests.integration.harness import REAL_WORKER_ENV, eventually, health_turns_503, start_cluster

REAL_BOOT = "ferry.services.worker.boot:boot_worker"
FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--moe-cache-size", "10"]


def completions(c) -> tuple[str, str, str]:
    client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    greedy = client.completions.create(model="tiny", prompt="hello world, this is", max_tokens=12, temperature=0)
    seeded = client.completions.create(
        model="tiny", prompt="hello world, this is", max_tokens=12, temperature=0.8, seed=3
    )
    # unseeded: each rank draws its own noise, from the seed rank 0 handed it; a rank that drew other
    # tokens would stop the worker (follow's check) and this request would fail
    unseeded = client.completions.create(
        model="tiny", prompt="unseeded", max_tokens=40, temperature=1.0, extra_body={"ignore_eos": True}
    )  # all 40: a sampled end must not cut it
    assert unseeded.choices[0].finish_reason == "length"
    return greedy.choices[0].text, seeded.choices[0].text, unseeded.choices[0].text


def assert_two_ranks_serve_as_one(model, tmp_path, flags, ready_timeout: float, then_on_two_ranks=None) -> None:
    """One rank, then two, with `flags`: greedy and seeded completions give the same text as one rank holding
    every expert, and rank 1 sampled every unseeded token as rank 0 did. `then_on_two_ranks(cluster)`, if given,
    runs on the two-rank cluster after those checks, before it is stopped (a second check without a second boot)."""
    got = {}
    for world in ("1", "2"):
        c = start_cluster(
            model,
            tmp_path / world,
            worker_flags=[*flags, "--expert-parallel-size", world],
            boot=REAL_BOOT,
            worker_env=REAL_WORKER_ENV,
            wait=False,
        )
        try:
            c.wait_ready(timeout=ready_timeout)
            got[world] = completions(c)
            if world == "2":
                assert "expert_parallel_followers" in c.log("worker")
                assert "sampled other tokens" not in c.log("worker")
                assert got["2"][:2] == got["1"][:2], got
                if then_on_two_ranks is not None:
                    then_on_two_ranks(c)
        finally:
            c.stop()
    assert "sampled other tokens" not in c.log("worker")


@pytest.mark.slow
def test_two_ranks_serve_as_one(tmp_path, tiny_models):
    """qwen3_5_moe; qwen3_moe's is the lost-rank test's first half, below."""
    assert_two_ranks_serve_as_one(tiny_models["qwen3_5_moe"], tmp_path, FLAGS, ready_timeout=180)


def follower_pid(c) -> int:
    for line in c.log("worker").splitlines():
        if line.startswith("{") and "expert_parallel_followers" in line:
            return json.loads(line)["pids"][0]
    raise AssertionError("rank 0 did not log its followers: " + c.log("worker")[-2000:])


def assert_a_lost_rank_fails_its_requests_and_health_turns_503(c) -> None:
    client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.completions.create(
        model="tiny", prompt="a long one", max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # generating
    os.kill(follower_pid(c), signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert "expert-parallel rank 1 of 2" in str(err.value) and time.monotonic() - killed < 30, err.value
    health_turns_503(c.base_url, "worker", timeout=30)
    assert eventually(lambda: c.procs["worker"].poll() is not None, timeout=10)
    assert c.procs["worker"].returncode == 3  # RANK_FAILURE_EXIT


@pytest.mark.slow
def test_two_ranks_serve_as_one_and_a_lost_rank_fails_its_requests_and_health_turns_503(tiny_models, tmp_path):
    """The parity above for qwen3_moe, then on the same two ranks (one boot, not two): a rank killed mid-stream
    fails the stream naming it, /health turns 503 and the worker exits with RANK_FAILURE_EXIT."""
    assert_two_ranks_serve_as_one(
        tiny_models["qwen3_moe"],
        tmp_path,
        FLAGS,
        ready_timeout=180,
        then_on_two_ranks=assert_a_lost_rank_fails_its_requests_and_health_turns_503,
    )


def test_a_rank_lost_while_the_worker_boots_ends_it_at_once(tiny_models, tmp_path):
    """Rank 1 killed as soon as rank 0 has started it: rank 0, waiting for it in the rendezvous or in a
    collective of the boot, must not wait for the group's timeout."""
    c = start_cluster(
        tiny_models["qwen3_moe"],
        tmp_path / "c",
        worker_flags=[*FLAGS, "--expert-parallel-size", "2"],
        boot=REAL_BOOT,
        worker_env=REAL_WORKER_ENV,
        wait=False,
    )
    try:
        pid = eventually(lambda: follower_pid_or_none(c), timeout=60)
        os.kill(pid, signal.SIGKILL)
        assert eventually(lambda: c.procs["worker"].poll() is not None, timeout=30), c.log("worker")[-2000:]
        assert c.procs["worker"].returncode == 3 and "expert-parallel rank 1 of 2 exited" in c.log("worker")
    finally:
        c.stop()


def follower_pid_or_none(c) -> int | None:
    try:
        return follower_pid(c)
    except AssertionError:
        return None


def test_ranks_whose_banks_fit_the_host_alone_but_not_together_stop_at_boot_naming_the_flag(tiny_models, tmp_path):
    """Two ranks, each with its banks and its process's reserve within --host-memory, the two together not:
    the ranks check their banks together before any pins one (boot's _ranks_host_checked), and the worker stops
    with the plan's error rather than booting into the OOM killer."""
    from ferry.plan.host_memory import HOST_RESERVE_BYTES

    room = HOST_RESERVE_BYTES * 3 // 2
    c = start_cluster(
        tiny_models["qwen3_moe"],
        tmp_path / "c",
        worker_flags=[*FLAGS, "--expert-parallel-size", "2", "--host-memory", f"{room}B"],
        boot=REAL_BOOT,
        worker_env=REAL_WORKER_ENV,
        wait=False,
    )
    try:
        assert eventually(lambda: c.procs["worker"].poll() is not None, timeout=120), c.log("worker")[-2000:]
        log = c.log("worker")
        assert c.procs["worker"].returncode == 2, log[-2000:]
        assert "the 2 GPUs' expert banks do not fit in host RAM" in log and "--host-memory" in log, log[-2000:]
    finally:
        c.stop()
