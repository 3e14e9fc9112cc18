"""The worker process's control loop: boot the executor, report the pools, execute steps.

Thin on purpose: everything about the model lives behind `boot_worker(cfg) -> (executor, plan)` and
`executor.execute(StepBatch) -> StepOutput`. A heartbeat thread with its own socket announces the
worker (and, once booted, its PoolReport) every HEARTBEAT_INTERVAL_S, so the scheduler notices a
dead worker even while a long step runs here.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import secrets
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import structlog
import zmq

from ferry.plan.mtp_layer import MtpChainBytes
from ferry.services.worker.compile_watch import CompileWatch
from ferry.services.worker.flags import WorkerBootConfig
from ferry.services.worker.metrics import WorkerMetrics
from ferry.shared.errors import ConfigError
from ferry.shared.liveness import HEARTBEAT_INTERVAL_S, Liveness
from ferry.shared.messages import (
    PoolReport,
    RunStep,
    SchedulerBeat,
    SchedulerToWorker,
    StepDone,
    StepFailed,
    WorkerAlive,
)
from ferry.shared.side_http import serve_side_http
from ferry.shared.startup_heap import freeze_startup_heap
from ferry.shared.step_trace import StepTrace
from ferry.shared.wire import PeerSocket, WireError
from ferry.shared.wire_keys import WireKeys, require_keys_for_tcp

log = structlog.get_logger("worker")

# How often the loop looks at a launched step's completion while it also waits for the next step
# (milliseconds, whole: ZeroMQ's poll takes no less): what it adds to a step's answer at most. The
# next step, if sent ahead, is already queued on the device, so the device does not wait for it.
WATCH_INTERVAL_MS = 1
# An expert-parallel rank that exits ends the worker: after failing its step it exits with this status,
# at the latest this long after the failure was seen (a collective with the lost rank may never return)
RANK_FAILURE_EXIT = 3
RANK_FAILURE_GRACE_S = 5.0
# on stop, rank 0 waits this long for each follower to exit before killing it
FOLLOWER_STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class WorkerConfig:
    steps_addr: str  # the scheduler's PUSH; we connect a PULL
    results_addr: str  # the scheduler's PULL; we connect PUSHes (main loop and heartbeat thread)
    health_host: str
    health_port: int | None
    boot: str  # "module:function" taking a WorkerBootConfig, returning (executor, plan)
    wire_keys: str | None = None  # the CURVE key directory (shared/wire_keys.py); None: no CURVE


def pool_report_from_plan(plan: Any, vocab_size: int = 0, spec: Any = None, draft_vocab: int = 0) -> PoolReport:
    """The scheduler's view of the memory plan (ferry.plan.planner.Plan); `spec` (the model's ModelSpec, None
    where unknown) adds its MoE layers and top-k, which the draft-length controller prices misses with;
    `draft_vocab`: --speculative-draft-vocab, the LM head rows an MTP chain position reads (0: all)."""
    moe = spec is not None and getattr(spec, "num_experts", 0) > 0
    # the drafting spec (plan/mtp_layer.py's drafting_spec) keeps the MTP layer's K/V: the worker chains MTP drafts
    mtp = spec is not None and getattr(spec, "mtp_kv_layers", 0)
    chain = MtpChainBytes.of(spec, plan.dtype, draft_vocab) if mtp else None
    return PoolReport(
        kv_pages=plan.kv.pages,
        page_size=plan.kv.page_size,
        linear_state_slots=plan.linear_state.slots,
        max_running_requests=plan.max_running_requests,
        max_prefill_tokens=plan.max_prefill_tokens,
        max_model_len=plan.max_model_len,
        vocab_size=vocab_size,
        linear_state_snapshots=plan.linear_state_snapshots.snapshots,
        experts_offloaded=plan.experts.slots < plan.experts.total,
        kv_ring_slots=plan.kv.ring_slots,
        expert_slots=plan.experts.slots,
        expert_total=plan.experts.total,
        moe_layers=len(spec.moe_layer_indices) if moe else 0,
        experts_top_k=spec.num_experts_per_tok if moe else 0,
        expert_bytes=plan.experts.bytes_per_slot,
        mtp_lm_head_bytes=chain.lm_head if chain else 0,
        mtp_layer_bytes=chain.layer if chain else 0,
        mtp_row_expert_bytes=chain.row_experts if chain else 0,
        plan_summary=f"{plan.kv.pages} KV pages x {plan.kv.page_size} tokens, "
        f"{plan.linear_state.slots} linear-state slots, "
        f"{plan.linear_state_snapshots.snapshots} linear-state snapshots, "
        f"{plan.experts.slots}/{plan.experts.total} expert slots",
    )


def load_boot(spec: str) -> Callable[[WorkerBootConfig], tuple[Any, Any]]:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--boot {spec!r}: cannot load it ({exc})") from exc


class _Heartbeat(threading.Thread):
    def __init__(self, ctx: zmq.Context, cfg: WorkerConfig, boot_id: str, secure=None):
        super().__init__(name="worker-heartbeat", daemon=True)
        self.sock = PeerSocket(ctx, zmq.PUSH, cfg.results_addr, None, bind=False, secure=secure)
        self.sock.sock.setsockopt(zmq.SNDHWM, 4)  # a scheduler that is away need not get a backlog of beats
        self.boot_id = boot_id
        self.pool: PoolReport | None = None
        self.expert_stats: Callable[[], tuple[int, int]] | None = None
        self.step_started: float | None = None  # time.monotonic() when the current step began
        self.last_step = 0  # the id of the last step received
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_INTERVAL_S):
            hits, misses = self.expert_stats() if self.expert_stats else (0, 0)
            started = self.step_started
            running = time.monotonic() - started if started is not None else 0.0
            self.sock.send(
                WorkerAlive(
                    boot_id=self.boot_id,
                    pool=self.pool,
                    step_running_s=running,
                    expert_hits=hits,
                    expert_misses=misses,
                    last_step=self.last_step,
                ),
                block=False,
            )
        self.sock.close()


class WorkerService:
    def __init__(self, cfg: WorkerConfig, boot_config: WorkerBootConfig, ctx: zmq.Context | None = None):
        self.cfg, self.boot_config = cfg, boot_config
        self.ctx = ctx or zmq.Context.instance()
        self.boot_id = uuid.uuid4().hex
        self.metrics = WorkerMetrics()
        self.plan: Any = None
        self.executor: Any = None
        self._running = True
        self.ranks = None  # expert parallelism: the rank group rank 0 leads (expert_ranks.py)
        self._answered: tuple[int, bytes] | None = None  # the last answered step's id and tokens, for the ranks' check
        self.rank_failure: str | None = None  # set by the followers' watch: the worker stops, failing its step
        for flag, addr in (("--steps-addr", cfg.steps_addr), ("--results-addr", cfg.results_addr)):
            require_keys_for_tcp(flag, addr, cfg.wire_keys)
        secure = WireKeys(cfg.wire_keys, "worker").client() if cfg.wire_keys else None
        # steps arrive on a DEALER named by the boot id: the scheduler addresses the worker it adopted
        self.steps = PeerSocket(
            self.ctx,
            zmq.DEALER,
            cfg.steps_addr,
            SchedulerToWorker,
            bind=False,
            identity=self.boot_id.encode(),
            secure=secure,
        )
        self.results = PeerSocket(self.ctx, zmq.PUSH, cfg.results_addr, None, bind=False, secure=secure)
        self.heartbeat = _Heartbeat(self.ctx, cfg, self.boot_id, secure)
        self.trace = StepTrace("worker")  # FERRY_STEP_TRACE: each step's timeline (bench/profile_serve.py)
        self.compile_watch = CompileWatch()  # Triton compiles once ready: what the warm-up missed
        self.scheduler = Liveness()  # the adopting scheduler's beats (SchedulerBeat)
        self.http = None
        if cfg.health_port is not None:
            self.http = serve_side_http(cfg.health_host, cfg.health_port, self._health, self.metrics.registry)

    def _health(self) -> tuple[bool, dict]:
        """Ready once booted and adopted by a live scheduler; the plan's figures, never a path, and never
        the boot id (whoever knows it could pose as this worker on a wire without keys)."""
        if self.rank_failure is not None:
            return False, {"status": "unavailable", "reason": self.rank_failure}
        if self.plan is None:
            return False, {"status": "loading"}
        silent = self.scheduler.silent_for()
        if silent is None:
            peer = "no scheduler has adopted this worker yet"
        elif not self.scheduler.alive():
            peer = f"the scheduler stopped responding ({silent:.1f}s without a beat)"
        else:
            peer = ""
        body = {
            "status": "unavailable" if peer else "ready",
            "peers": {"scheduler": peer or "ready"},
            "plan": without_paths(self.plan.to_dict()),
        }
        if peer:
            body["reason"] = peer
        return not peer, body

    def boot(self) -> None:
        self.heartbeat.start()  # the scheduler hears "loading" while the model loads
        t0 = time.monotonic()
        try:
            if self.boot_config.expert_parallel_size > 1:
                self._start_ranks()
            self.executor, self.plan = load_boot(self.cfg.boot)(self.boot_config)
            if self.ranks is not None:
                from ferry.services.worker.expert_ranks import check_same_plans

                check_same_plans(self.ranks, self.plan)
        except BaseException:
            if self.ranks is not None:
                self._leave_ranks()
            raise
        stats = getattr(self.executor, "expert_stats", None)  # (hits, misses) from the expert cache, if it has one
        self.heartbeat.expert_stats = stats if callable(stats) else None
        report = getattr(self.executor, "expert_cache_report", None)  # a test double's boot may have none
        if callable(report):
            self.metrics.watch_expert_cache(report)
        if self.trace.enabled and hasattr(self.executor, "trace_device"):
            self.executor.trace_device = True
        vocab = getattr(self.executor, "vocab_size", 0)
        # before the pool is reported (no step can arrive yet): no full collection walks the booted model again
        freeze_startup_heap()
        head = getattr(getattr(self.executor, "mtp", None), "head", None)  # a test double's boot may have none
        self.heartbeat.pool = pool_report_from_plan(
            self.plan,
            vocab if isinstance(vocab, int) else 0,
            getattr(self.executor, "spec", None),
            getattr(head, "draft_vocab", 0),
        )
        # from here a Triton compile is one the warm-up missed, inside a request: logged and counted
        if self.compile_watch.install():
            self.metrics.watch_compiles(self.compile_watch.report)
        # the plan itself: the boot's short `plan` line (every term: `plan_detail` at debug, /health, `ferry plan`)
        log.info("worker_ready", boot_s=round(time.monotonic() - t0, 3), compile_watch=self.compile_watch.installed)

    def _start_ranks(self) -> None:
        """Rank 0 of an expert-parallel worker: start the followers and join their group before booting (the
        boot's own steps run on every rank)."""
        from ferry.plan.host_memory import mem_available_bytes
        from ferry.services.worker.device import select_device
        from ferry.services.worker.expert_ranks import (
            FollowerWatch,
            RankGroup,
            check_rank_devices,
            init_group,
            start_followers,
        )
        from ferry.services.worker.flags import worker_flag_args

        world = self.boot_config.expert_parallel_size
        check_rank_devices(self.boot_config.device, world)
        # the host as it is before any rank pins a bank: what the ranks' banks are checked against together
        self.boot_config = dataclasses.replace(
            self.boot_config, sampler_seed=secrets.randbits(63), host_available_bytes=mem_available_bytes()
        )
        followers, rendezvous = start_followers(
            world,
            worker_flag_args(self.boot_config),
            self.boot_config.sampler_seed,
            self.boot_config.host_available_bytes,
        )
        self.ranks = RankGroup(0, world, None, followers, rendezvous)
        # watched from before the group meets: a follower that fails to start would leave the rendezvous
        # (and rank 0 in it) waiting for the group's timeout
        self.ranks.watch = FollowerWatch(self.ranks, self._rank_failed)
        self.ranks.watch.start()
        self.ranks.control = init_group(0, world, rendezvous, select_device(self.boot_config.device))

    def _rank_failed(self, reason: str) -> None:
        """From the followers' watch: the loop fails the step in flight and stops; if it is stuck in a
        collective that will not return, the process ends here after a grace."""
        log.error("expert_parallel_rank_failed", reason=reason)
        self.rank_failure = reason
        self._running = False

        def end() -> None:
            from ferry.services.worker.expert_ranks import remove_rendezvous

            remove_rendezvous(self.ranks.rendezvous)
            os._exit(RANK_FAILURE_EXIT)

        timer = threading.Timer(RANK_FAILURE_GRACE_S, end)
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        self._running = False

    def run(self) -> None:
        """Steps are launched as they arrive and answered in order. While a launched step runs on the
        device, the loop watches both: a step the scheduler sent ahead is launched as soon as it
        arrives (queued on the device behind the running one, which feeds it its tokens), and the
        running step is answered once the device is done with it. So the device goes from one step to
        the next without waiting for this loop or for the scheduler."""
        self.boot()
        pending = None  # (batch, launched, started, received): launched, not yet answered
        while self._running or (self.rank_failure and pending is not None):
            if self.rank_failure is not None:  # a rank is gone: its step cannot finish
                if pending is not None:
                    self._fail(pending[0], RuntimeError(self.rank_failure))
                    pending = None
                break
            if pending is not None and self._done(pending[1]):
                self.scheduler.deaf()
                self._answer(*pending)
                pending = None
            if not self.steps.sock.poll(0):
                # Everything sent is read: the scheduler's silence counts from here again, and with no
                # step running the heartbeat may say idle (not before: a step waiting unread in the
                # socket must not pass for a step never received, in the scheduler's lost-step check).
                self.scheduler.hearing()
                if pending is None:
                    self.heartbeat.step_started = None
                if not self.steps.sock.poll(200 if pending is None else WATCH_INTERVAL_MS):
                    continue
            # busy from here until the socket is empty again: a long step is not the scheduler's silence
            self.scheduler.deaf()
            try:
                msg = self.steps.recv()
            except WireError as exc:
                log.error("bad_scheduler_message", error=str(exc))
                continue
            match msg:
                case RunStep(batch=batch):
                    self.heartbeat.last_step = batch.step_id
                    if self.heartbeat.step_started is None:
                        self.heartbeat.step_started = time.monotonic()
                    started, received = time.perf_counter(), time.monotonic()
                    launched = self._launch(batch)
                    if pending is not None:
                        self._answer(*pending)
                    pending = None
                    if isinstance(launched, Exception):
                        self._fail(batch, launched)
                    else:
                        pending = (batch, launched, started, (received, time.monotonic()))
                        self.heartbeat.step_started = time.monotonic()  # the step now running
                case SchedulerBeat():
                    self.scheduler.beat()
        self.close()

    def _launch(self, batch):
        """The executor's handle on the launched step, or the exception that stopped it. An executor
        without `launch` (a test double) runs the whole step here."""
        try:
            if self.ranks is not None:  # every rank runs the step; rank 0 hands it on first
                from ferry.services.worker.expert_ranks import share_step

                share_step(self.ranks, batch, self._answered)
            launch = getattr(self.executor, "launch", None)
            return launch(batch) if launch is not None else self.executor.execute(batch)
        except Exception as exc:  # noqa: BLE001 - a failed step must reach the scheduler, not kill the worker
            log.exception("step_failed", step_id=batch.step_id)
            self._rank_step_failed(batch, exc)
            return exc

    def _done(self, launched) -> bool:
        done = getattr(self.executor, "done", None)  # a test double answers at launch
        return done(launched) if done is not None else True

    def _answer(self, batch, launched, started: float, received: tuple[float, float]) -> None:
        try:
            output = self.executor.finish(launched) if hasattr(self.executor, "launch") else launched
        except Exception as exc:  # noqa: BLE001
            log.exception("step_failed", step_id=batch.step_id)
            self._rank_step_failed(batch, exc)
            self._fail(batch, exc)
            return
        self.metrics.observe_step(time.perf_counter() - started, len(batch.tokens), len(batch.req_ids))
        if self.ranks is not None:
            from ferry.services.worker.expert_ranks import tokens_of

            self._answered = (output.step_id, tokens_of(output))
        # the answer goes out before the heartbeat may say "idle" (run, once the socket is empty): the
        # scheduler must not hand out a new step while this one's answer is still on its way
        answered = time.monotonic()  # the trace's: before the send, so the hop counts the send's own time
        self.results.send(StepDone(output))
        if self.trace.enabled:
            device = getattr(launched, "device_times", None) or (None, None)
            self.trace.add(
                step=batch.step_id,
                rows=len(batch.req_ids),
                tokens=len(batch.tokens),
                drafts=int(batch.draft_lens.sum()) if batch.draft_lens is not None else 0,
                longest=int(batch.query_lens.max()) if len(batch.req_ids) else 0,  # the longest row's tokens
                recv=received[0],
                launched=received[1],
                answered=answered,
                device_ms=device[0],
                idle_ms=device[1],
            )

    def _rank_step_failed(self, batch, exc: Exception) -> None:
        """An expert-parallel step that failed past the executor's checks ends the worker: the ranks'
        collectives would no longer pair. The reason names the rank that went, where one did."""
        from ferry.services.worker.executor import StepBatchError

        if self.ranks is None or self.rank_failure is not None or isinstance(exc, StepBatchError):
            return
        from ferry.services.worker.expert_ranks import failed_follower

        time.sleep(0.2)  # a follower's exit is seen a moment after its socket closes
        self.rank_failure = failed_follower(self.ranks) or f"expert-parallel rank 0 failed step {batch.step_id}: {exc}"
        self._running = False

    def _fail(self, batch, exc: Exception) -> None:
        if self.rank_failure is not None:
            exc = RuntimeError(self.rank_failure)
        self.results.send(StepFailed(step_id=batch.step_id, message=f"{type(exc).__name__}: {exc}"))

    def close(self) -> None:
        if self.ranks is not None:
            self._stop_ranks()
        self.trace.flush()
        self.heartbeat.stopped.set()
        self.heartbeat.join(timeout=2)
        self.steps.close()
        self.results.close()
        if self.http is not None:
            self.http.shutdown()

    def _stop_ranks(self) -> None:
        """Tell the followers to stop (they may be gone already) and reap them."""
        from ferry.services.worker.expert_ranks import remove_rendezvous, share_step

        if self.ranks.watch is not None:
            self.ranks.watch.stopped.set()  # the followers' exits from here on are this stop's
        if self.rank_failure is None and self.ranks.control is not None:
            try:
                share_step(self.ranks, None)
            except RuntimeError:
                pass
        self._reap_followers()
        remove_rendezvous(self.ranks.rendezvous)

    def _leave_ranks(self) -> None:
        """Rank 0's boot failed: leave the group (expert_ranks.leave_group: the followers' collectives end),
        reap the followers, which fail with it, and remove the rendezvous; the boot's error is then raised."""
        from ferry.services.worker.expert_ranks import leave_group, remove_rendezvous

        if self.ranks.watch is not None:
            self.ranks.watch.stopped.set()  # their exits are this failure's, not a rank failing later
        leave_group()
        self._reap_followers()
        remove_rendezvous(self.ranks.rendezvous)
        self.ranks = None  # close() has nothing left to stop

    def _reap_followers(self, grace_s: float = FOLLOWER_STOP_GRACE_S) -> None:
        for proc in self.ranks.followers:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_PATH = re.compile(r"(?<![\w.])(?:~|\.{1,2})?/[^\s,;:()'\"]+")


def without_paths(value: Any) -> Any:
    """The plan for /health with every file-system path in its strings replaced by "<path>": a health
    probe may be public, and the host's layout (model directory, cache, /proc) is none of its business."""
    if isinstance(value, dict):
        return {k: without_paths(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_paths(v) for v in value]
    if isinstance(value, str):
        return _PATH.sub("<path>", value)
    return value
