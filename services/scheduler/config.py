"""The scheduler's frozen configuration, built once from flags / FERRY_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from ferry.services.scheduler.batcher import (
    ARRIVAL_GAP_FRACTION,
    DEFAULT_PREFILL_COALESCE_MS,
    DEFAULT_SCHEDULE_AHEAD_STEPS,
)
from ferry.services.scheduler.oracle_drafter import BenchDrafts, bench_drafts_from_env
from ferry.shared.defaults import API_ADDR, RESULTS_ADDR, STEP_TIMEOUT_S, STEPS_ADDR
from ferry.shared.errors import ConfigError
from ferry.shared.side_http import add_side_http_flags
from ferry.shared.speculation import (
    DEFAULT_SPECULATIVE_TOKENS,
    SPECULATIVE_METHOD_HELP,
    SPECULATIVE_METHODS,
    SPECULATIVE_TOKENS_HELP,
    speculation_problems,
)
from ferry.shared.wire_keys import WireKeys, add_wire_keys_flag, check_exposure, require_keys_for_tcp

ARRIVAL_GAP_MS = DEFAULT_PREFILL_COALESCE_MS * ARRIVAL_GAP_FRACTION


@dataclass(frozen=True)
class SchedulerConfig:
    api_addr: str  # ROUTER, bound: api replicas connect their DEALERs here
    steps_addr: str  # PUSH, bound: the worker's PULL connects here
    results_addr: str  # PULL, bound: the worker's PUSH connects here
    health_host: str
    health_port: int | None  # side port for /health and /metrics; None: no side server
    step_timeout_s: float  # a worker step running longer than this counts as a hung worker
    wire_keys: str | None = None  # the CURVE key directory (shared/wire_keys.py); None: no CURVE
    # how many decode steps may go out ahead of the oldest unanswered one (batcher.py; 0: --no-schedule-ahead)
    schedule_ahead_steps: int = DEFAULT_SCHEDULE_AHEAD_STEPS
    prefix_cache: bool = True  # reuse cached prompt prefixes (False: --no-prefix-cache)
    prefill_coalesce_s: float = DEFAULT_PREFILL_COALESCE_MS / 1000  # --prefill-coalesce-ms (batcher.arrival_hold_s)
    speculative_method: str = "off"  # --speculative-method (shared/speculation.py)
    speculative_tokens: int = DEFAULT_SPECULATIVE_TOKENS  # --speculative-tokens: drafts a row at most
    # benchmark-only switches from FERRY_BENCH_* (oracle_drafter.py; refused without FERRY_BENCH_ONLY=1)
    bench_drafts: BenchDrafts = field(default_factory=BenchDrafts)

    @property
    def schedule_ahead(self) -> bool:
        """Whether a decode step's successor goes out before its answer."""
        return self.schedule_ahead_steps > 0


def add_scheduler_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("scheduler")
    g.add_argument("--api-addr", default=API_ADDR, help="where the scheduler's ROUTER binds (api replicas connect)")
    g.add_argument("--steps-addr", default=STEPS_ADDR, help="where the scheduler pushes steps (worker connects)")
    g.add_argument("--results-addr", default=RESULTS_ADDR, help="where the scheduler pulls results (worker connects)")
    add_side_http_flags(g)
    add_step_timeout_flag(g)
    add_schedule_ahead_flag(g)
    add_prefix_cache_flag(g)
    add_prefill_coalesce_flag(g)
    add_speculation_flags(g)
    add_wire_keys_flag(g)


def add_step_timeout_flag(group) -> None:
    """`--step-timeout`, for `ferry scheduler` and `ferry serve` (which passes it on)."""
    group.add_argument(
        "--step-timeout",
        type=float,
        default=STEP_TIMEOUT_S,
        help=f"seconds one worker step may run before its requests fail as hung (default {STEP_TIMEOUT_S:g})",
    )


MAX_SCHEDULE_AHEAD_STEPS = 4  # past a few, a request's end only costs more steps computed for nothing


def add_schedule_ahead_flag(group) -> None:
    """`--no-schedule-ahead` and `--schedule-ahead-steps`, for `ferry scheduler` and `ferry serve` (which
    passes them on)."""
    group.add_argument(
        "--no-schedule-ahead",
        dest="schedule_ahead",
        action="store_false",
        help="send each decode step only after the worker answered the one before (by default the "
        "next decode step goes out at once, and the worker feeds it the tokens it samples)",
    )
    group.add_argument(
        "--schedule-ahead-steps",
        type=int,
        default=DEFAULT_SCHEDULE_AHEAD_STEPS,
        metavar="N",
        help="decode steps that may go out ahead of the oldest one not yet answered, each fed the "
        f"tokens the step before it samples (default {DEFAULT_SCHEDULE_AHEAD_STEPS}, which keeps the "
        "scheduler's turn and both hops off the device's path when they take longer than a step, "
        "as they do for a resident single stream; 1 wastes less when requests stop on a stop "
        f"string or EOS; at most {MAX_SCHEDULE_AHEAD_STEPS})",
    )


def schedule_ahead_steps(args: argparse.Namespace) -> int:
    """--schedule-ahead-steps, checked (--no-schedule-ahead turns them off: SchedulerConfig's 0)."""
    steps = getattr(args, "schedule_ahead_steps", DEFAULT_SCHEDULE_AHEAD_STEPS)
    if not 1 <= steps <= MAX_SCHEDULE_AHEAD_STEPS:
        raise ConfigError(
            f"--schedule-ahead-steps must be between 1 and {MAX_SCHEDULE_AHEAD_STEPS}, got {steps} "
            "(--no-schedule-ahead turns scheduling ahead off)"
        )
    return steps


def add_prefill_coalesce_flag(group) -> None:
    """`--prefill-coalesce-ms`, for `ferry scheduler` and `ferry serve` (which passes it on)."""
    group.add_argument(
        "--prefill-coalesce-ms",
        type=float,
        default=DEFAULT_PREFILL_COALESCE_MS,
        metavar="MS",
        help="with experts offloaded and nothing running, new prompts wait for more to arrive while "
        "they keep arriving (MS/3 apart at most: a lone prompt waits that long), up to MS after "
        "the first, so that one prefill step (one pass over the experts without a GPU slot) "
        f"serves them all; 0: each goes at once (default {DEFAULT_PREFILL_COALESCE_MS:g}, "
        f"so {ARRIVAL_GAP_MS:g} ms apart)",
    )


def add_speculation_flags(group) -> None:
    """`--speculative-method` and `--speculative-tokens`, for `ferry scheduler` (`ferry serve` has them among the
    planner's flags: the worker plans the MTP layer's memory and captures the verify graphs with them)."""
    group.add_argument(
        "--speculative-method", default="off", metavar="|".join(SPECULATIVE_METHODS), help=SPECULATIVE_METHOD_HELP
    )
    group.add_argument(
        "--speculative-tokens", type=int, default=DEFAULT_SPECULATIVE_TOKENS, metavar="K", help=SPECULATIVE_TOKENS_HELP
    )


def speculation_from_args(args: argparse.Namespace) -> tuple[str, int]:
    """(--speculative-method, --speculative-tokens), checked."""
    method = getattr(args, "speculative_method", None) or "off"  # the planner's flag: None where not given
    tokens = getattr(args, "speculative_tokens", None)  # the planner's flag: None where not given
    tokens = DEFAULT_SPECULATIVE_TOKENS if tokens is None else tokens
    problems = speculation_problems(method, tokens)
    if problems:
        raise ConfigError("; ".join(problems))
    return method, tokens


def add_prefix_cache_flag(group) -> None:
    """`--no-prefix-cache`, for `ferry scheduler` and `ferry serve` (which passes it on)."""
    group.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="compute every prompt whole: no KV pages or linear-state snapshots are reused from "
        "earlier requests, for any architecture (by default a prompt starts after the longest "
        "cached prefix it shares; hybrid models from the deepest linear-state snapshot on it)",
    )


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    if args.step_timeout <= 0:
        raise ConfigError(f"--step-timeout must be positive, got {args.step_timeout}")
    ahead_steps = schedule_ahead_steps(args)
    method, draft_tokens = speculation_from_args(args)
    bench_drafts = bench_drafts_from_env(os.environ, method)
    keys = getattr(args, "wire_keys", None)
    if keys:
        WireKeys(keys, "scheduler")  # a missing or unreadable key is a config error now, not at the first socket
    for flag, addr in (
        ("--api-addr", args.api_addr),
        ("--steps-addr", args.steps_addr),
        ("--results-addr", args.results_addr),
    ):
        check_exposure(flag, addr, keys)
        require_keys_for_tcp(flag, addr, keys or None, getattr(args, "insecure_wire", None))
    return SchedulerConfig(
        args.api_addr,
        args.steps_addr,
        args.results_addr,
        args.health_host,
        args.health_port,
        args.step_timeout,
        keys or None,
        schedule_ahead_steps=ahead_steps if args.schedule_ahead else 0,
        prefix_cache=getattr(args, "prefix_cache", True),
        prefill_coalesce_s=prefill_coalesce_s(args.prefill_coalesce_ms),
        speculative_method=method,
        speculative_tokens=draft_tokens,
        bench_drafts=bench_drafts,
    )


def prefill_coalesce_s(ms: float) -> float:
    """--prefill-coalesce-ms, checked, in seconds."""
    if not 0 <= ms <= 1000:
        raise ConfigError(f"--prefill-coalesce-ms must be between 0 and 1000, got {ms:g}")
    return ms / 1000
