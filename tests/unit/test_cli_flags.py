"""The command line as people coming from vLLM type it: `--help` of every command at once (no torch
to print it), the model positionally, the serve flags forwarded to the three processes with nothing
secret on a command line, and the scheduler's and worker's /metrics ports on by default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ferry.services.cli import COMMANDS, build_parser
from ferry.services.serve_command import child_commands, child_environments, side_ports, write_api_key
from ferry.shared.errors import ConfigError
from tests.helpers import QWEN3_30B
from tests.integration.harness import port_free

NO_HEAVY_IMPORTS = """
import sys
from ferry.services.cli import main
try:
    main(sys.argv[1:] + ["--help"])
except SystemExit as exc:
    assert exc.code == 0, exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers", "triton", "tokenizers"})
assert not heavy, heavy
"""


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_prints_without_importing_torch(command):
    """`--help` is quick because it imports nothing heavy; its time on a given machine: bench/cli_help.py."""
    argv = [command] if command else []
    done = subprocess.run([sys.executable, "-c", NO_HEAVY_IMPORTS, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage: ferry" in done.stdout, done.stderr


def parse(*argv: str):
    return build_parser(argv[0]).parse_args(list(argv))


@pytest.mark.parametrize("command", ["serve", "plan", "generate"])
def test_the_model_can_be_given_positionally(command):
    extra = ["--prompt", "hi"] if command == "generate" else []
    assert parse(command, "/models/m", *extra).model == "/models/m"
    assert parse(command, "--model", "/models/m", *extra).model == "/models/m"


def test_vllm_aliases_reach_the_worker_as_the_planner_flags():
    args = parse(
        "serve",
        "/models/m",
        "--gpu-memory-utilization",
        "0.85",
        "--max-num-seqs",
        "12",
        "--gpu-memory",
        "24GiB",
        "--host-memory",
        "64GiB",
    )
    assert (args.memory_ratio, args.max_running_requests) == (0.85, 12)
    worker = child_commands(args, "/models/m", Path("/tmp/x"))["worker"]
    flags = dict(zip(worker[4:], worker[5:]))
    assert flags["--memory-ratio"] == "0.85" and flags["--max-running-requests"] == "12"
    assert flags["--gpu-memory"] == f"{24 * 2**30}B" and flags["--host-memory"] == f"{64 * 2**30}B"  # units kept
    assert parse("worker", "--model", "m", "--gpu-memory", flags["--gpu-memory"]).gpu_memory == 24 * 2**30


def test_expert_bank_and_copy_flags_reach_the_worker_from_serve_and_resolve_by_bank_format():
    from ferry.services.worker.flags import boot_config_from_args, copy_engine_tokens

    for extra, fmt, tokens in (
        ((), None, None),
        (("--expert-bank-format", "plain", "--expert-copy-engine-tokens", "4"), "plain", 4),
    ):
        worker = child_commands(parse("serve", "/models/m", *extra), "/models/m", Path("/tmp/x"))["worker"]
        assert ("--expert-bank-format" in worker) == (fmt is not None)
        cfg = boot_config_from_args(parse("worker", *worker[4:]))
        assert (cfg.plan.expert_bank_format, cfg.expert_copy_engine_tokens) == (fmt, tokens)
    assert copy_engine_tokens(None, plain_bf16_banks=True) == 8  # plain bf16 banks: the copy engine for 8+ tokens
    assert copy_engine_tokens(None, plain_bf16_banks=False) is None  # packed or quantized: copies in the graph
    assert copy_engine_tokens(3, plain_bf16_banks=False) == 3
    with pytest.raises(ValueError, match="--expert-copy-engine-tokens must be at least 1"):
        copy_engine_tokens(0, plain_bf16_banks=True)
    with pytest.raises(SystemExit):
        parse("serve", "/models/m", "--expert-bank-format", "zip")


def test_the_prefill_ring_chunks_reach_the_worker_from_serve_and_are_checked():
    from ferry.services.worker.flags import boot_config_from_args, ring_chunk

    for extra, chunks in (
        ((), (None, None)),
        (("--long-prefill-ring-chunk", "48"), (None, 48)),
        (("--prefill-ring-chunk", "24", "--long-prefill-ring-chunk", "48"), (24, 48)),
    ):
        worker = child_commands(parse("serve", "/models/m", *extra), "/models/m", Path("/tmp/x"))["worker"]
        assert ("--long-prefill-ring-chunk" in worker) == (chunks[1] is not None)
        cfg = boot_config_from_args(parse("worker", *worker[4:]))
        assert (cfg.prefill_ring_chunk, cfg.long_prefill_ring_chunk) == chunks
    assert ring_chunk(None, "--prefill-ring-chunk", 48) is None and ring_chunk(48, "--prefill-ring-chunk", 48) == 48
    with pytest.raises(ValueError, match="--long-prefill-ring-chunk must be at least 1 expert, got 0"):
        ring_chunk(0, "--long-prefill-ring-chunk")
    with pytest.raises(
        ValueError, match="--prefill-ring-chunk 64: a ring chunk must fit the plan's 48 prefill staging slots"
    ):
        ring_chunk(64, "--prefill-ring-chunk", 48)


def test_the_expert_backend_and_its_threads_reach_the_worker_from_serve():
    from ferry.services.worker.flags import boot_config_from_args

    for extra, backend, threads in (
        ((), None, None),
        (("--expert-backend", "hybrid", "--host-expert-threads", "12"), "hybrid", 12),
        (("--expert-backend", "gpu"), "gpu", None),
    ):
        worker = child_commands(parse("serve", "/models/m", *extra), "/models/m", Path("/tmp/x"))["worker"]
        assert ("--host-expert-threads" in worker) == bool(threads) and ("--expert-backend" in worker) == bool(backend)
        plan = boot_config_from_args(parse("worker", *worker[4:])).plan
        assert (plan.expert_backend, plan.host_expert_threads) == (backend, threads)
    with pytest.raises(SystemExit):
        parse("serve", "/models/m", "--expert-backend", "tpu")


def test_no_schedule_ahead_reaches_the_scheduler_from_serve():
    from ferry.services.scheduler.batcher import DEFAULT_SCHEDULE_AHEAD_STEPS
    from ferry.services.scheduler.config import scheduler_config_from_args

    assert DEFAULT_SCHEDULE_AHEAD_STEPS == 2  # a resident step is shorter than the chain from an answer to a launch
    for extra, ahead, steps in (
        ((), True, 2),
        (("--no-schedule-ahead",), False, 0),
        (("--schedule-ahead-steps", "1"), True, 1),
    ):
        scheduler = child_commands(parse("serve", "/models/m", *extra), "/models/m", Path("/tmp/x"))["scheduler"]
        assert ("--no-schedule-ahead" in scheduler) == (not ahead)
        cfg = scheduler_config_from_args(parse("scheduler", *scheduler[4:]))
        assert cfg.schedule_ahead is ahead and cfg.schedule_ahead_steps == steps
    for bad in ("0", "5"):
        with pytest.raises(ConfigError, match="--schedule-ahead-steps must be between 1 and 4"):
            scheduler_config_from_args(parse("scheduler", "--schedule-ahead-steps", bad))


def test_no_prefix_cache_reaches_the_scheduler_and_frees_the_workers_snapshots():
    from ferry.services.scheduler.config import scheduler_config_from_args
    from ferry.services.worker.flags import boot_config_from_args

    cases = (
        ((), True, None),
        (("--no-prefix-cache",), False, 0),
        (("--no-prefix-cache", "--linear-state-snapshots", "8"), False, 8),
        (("--linear-state-snapshots", "3"), True, 3),
    )
    for extra, cache, snapshots in cases:
        commands = child_commands(parse("serve", "/models/m", *extra), "/models/m", Path("/tmp/x"))
        assert scheduler_config_from_args(parse("scheduler", *commands["scheduler"][4:])).prefix_cache is cache
        # without the cache the snapshots' memory goes to the other pools, unless a count was asked for
        assert boot_config_from_args(parse("worker", *commands["worker"][4:])).plan.linear_state_snapshots == snapshots
    with pytest.raises(SystemExit):
        parse("worker", "--model", "m", "--linear-state-snapshots", "many")


def test_the_api_key_never_goes_on_a_command_line_nor_in_an_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRY_API_KEY", "s3cret")
    args = parse("serve")
    commands = child_commands(args, "/models/m", tmp_path)
    assert not any("s3cret" in part for cmd in commands.values() for part in cmd)
    envs = child_environments(args)
    assert not any("s3cret" in v for env in envs.values() for v in env.values())
    write_api_key(args, tmp_path)
    key_file = commands["api"][commands["api"].index("--api-key-file") + 1]
    assert open(key_file).read() == "s3cret" and os.stat(key_file).st_mode & 0o077 == 0


def test_serve_keeps_the_wire_keys_it_ignores_from_its_children(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRY_WIRE_KEYS", str(tmp_path))
    envs = child_environments(parse("serve"))
    assert not any("FERRY_WIRE_KEYS" in env for env in envs.values())


def _three_free_ports() -> int:
    """A port p with p, p + 1 and p + 2 all free now."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 2 < 65536 and all(port_free(p) for p in (port, port + 1, port + 2)):
            return port
    raise RuntimeError("no three consecutive free ports")


def test_side_metrics_ports_are_on_by_default_next_to_the_api_port():
    import socket

    port = _three_free_ports()
    assert side_ports(parse("serve", "--port", str(port))) == {"scheduler": port + 1, "worker": port + 2}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        chosen = side_ports(parse("serve", "--port", str(port)))
        assert chosen["scheduler"] not in (None, port, port + 1) and chosen["worker"] == port + 2
    assert side_ports(parse("serve", "--scheduler-health-port", "off", "--worker-health-port", "9999")) == {
        "scheduler": None,
        "worker": 9999,
    }


def test_bad_flags_are_refused_by_the_parser():
    for argv in (
        ["serve", "--worker-health-port", "often"],
        ["plan", str(QWEN3_30B), "--gpu-memory", "24"],
        ["serve", "--log-format", "xml"],
    ):
        with pytest.raises(SystemExit):
            parse(*argv)


# ---- what a newcomer types first ------------------------------------------------------------------------------


def test_version_prints_the_package_version_and_exits_0():
    import tomllib

    version = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run(
        [sys.executable, "-m", "ferry.services.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout == f"ferry {version}\n", done.stdout + done.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`ferry plan ... | head`: the reader closes the pipe; no BrokenPipeError traceback, the status
    of a tool killed by SIGPIPE (the read end is closed before the command starts, so it always hits)."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ferry.services.cli",
                "plan",
                str(QWEN3_30B),
                "--gpu-memory",
                "80GiB",
                "--moe-cache-rate",
                "1.0",
            ],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 128 + 13 and done.stderr == ""


def test_a_bad_dtype_lists_every_choice_auto_included():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferry.services.cli",
            "plan",
            str(QWEN3_30B),
            "--gpu-memory",
            "24GiB",
            "--dtype",
            "int7",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--dtype" in done.stderr
    assert "auto, bfloat16, float16, float32" in done.stderr, done.stderr
    assert (
        parse("plan", "m", "--dtype", "bf16").dtype == "bfloat16"
        and parse("plan", "m", "--dtype", "auto").dtype == "auto"
    )


def test_the_expert_parallel_size_reaches_the_worker_from_serve():
    from ferry.services.worker.flags import boot_config_from_args

    for extra, world in (
        ((), 1),
        (("--expert-parallel-size", "2"), 2),
        (("--tensor-parallel-size", "2", "--enable-expert-parallel"), 2),
    ):
        worker = child_commands(parse("serve", "/models/m", *extra), "/models/m", Path("/tmp/x"))["worker"]
        assert ("--expert-parallel-size" in worker) == (world > 1)
        assert boot_config_from_args(parse("worker", *worker[4:])).expert_parallel_size == world


def test_the_http_caps_reach_the_api_from_serve_and_are_checked():
    from ferry.services.api.config import api_config_from_args

    api = child_commands(
        parse("serve", "/models/m", "--max-header-size", "32KiB", "--max-connections", "50", "--header-timeout", "4"),
        "/models/m",
        Path("/tmp/x"),
    )["api"]
    args = parse("api", *api[4:])
    cfg = api_config_from_args(args, args.scheduler_addr, args.model)
    assert (cfg.max_header_bytes, cfg.max_connections, cfg.header_timeout_s) == (32 * 1024, 50, 4.0)
    defaults = api_config_from_args(parse("api", "--model", "m"), "ipc:///tmp/x/api.sock", "m")
    assert (defaults.max_header_bytes, defaults.max_connections, defaults.header_timeout_s) == (64 * 1024, 1024, 10.0)
    for flag, bad in (
        ("--max-header-size", "lots"),
        ("--max-header-size", "0"),
        ("--max-connections", "0"),
        ("--header-timeout", "-1"),
    ):
        with pytest.raises(ConfigError, match=flag):
            api_config_from_args(parse("api", "--model", "m", flag, bad), "ipc:///tmp/x/api.sock", "m")


def test_the_memory_ratio_help_states_the_planners_default():
    import argparse

    from ferry.plan.planner import DEFAULT_MEMORY_RATIO
    from ferry.plan.planner_flags import add_planner_flags

    parser = argparse.ArgumentParser()
    add_planner_flags(parser)
    (action,) = [a for a in parser._actions if a.dest == "memory_ratio"]
    assert f"(default {DEFAULT_MEMORY_RATIO:g}" in action.help
