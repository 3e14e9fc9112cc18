"""The scheduler process: a ZeroMQ loop between api replicas (ROUTER) and the worker (PUSH/PULL).

It owns no sizes of its own: a BatchScheduler is built from each new worker's PoolReport (carried by
the worker's heartbeat) and thrown away with that worker. Liveness runs both ways: a worker or api
replica silent for PEER_TIMEOUT_S is dead; a dead worker fails every request at once, a dead api
replica has its requests aborted.

Trust (docs/ARCHITECTURE.md §1): every message is checked before it changes anything, and a bad one
is answered for its request alone. Steps go to the adopted worker only (a ROUTER addressed by its boot
id: another peer on the steps port gets none, and one posing under the same id is refused); a second
worker that heartbeats while the adopted one is alive is ignored; a step is timed by this process's
own clock, so one that is never answered fails its requests whatever the worker's heartbeat says. No
/health (this one, the worker's, the api's) shows a boot id: it is the identity the steps port routes by.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import defaultdict

import msgspec
import numpy as np
import structlog
import zmq

from ferry.services.scheduler.batcher import BatchScheduler, Outcome
from ferry.services.scheduler.config import SchedulerConfig
from ferry.services.scheduler.metrics import SchedulerMetrics
from ferry.services.scheduler.oracle_drafter import OracleDrafter, record_sequence
from ferry.shared.errors import EngineError, FerryError, InvalidRequest, ServiceUnavailable
from ferry.shared.liveness import HEARTBEAT_INTERVAL_S, PEER_TIMEOUT_S, Liveness
from ferry.shared.messages import (
    Abort,
    ApiHeartbeat,
    ApiToScheduler,
    Failed,
    Finished,
    PoolReport,
    RunStep,
    SchedulerBeat,
    SchedulerStatus,
    StepDone,
    StepFailed,
    Submit,
    Tokens,
    WorkerAlive,
    WorkerToScheduler,
)
from ferry.shared.side_http import serve_side_http
from ferry.shared.startup_heap import freeze_startup_heap
from ferry.shared.step_trace import StepTrace
from ferry.shared.wire import PeerSocket, PeerWireError, RouterSocket, WireError
from ferry.shared.wire_keys import WireKeys

log = structlog.get_logger("scheduler")

# the BatchScheduler's running counts that SchedulerStatus carries and /metrics counts (a counter of that name)
COUNTED = (
    "prefix_hits",
    "snapshot_evictions",
    "draft_rows",
    "drafted_tokens",
    "accepted_drafts",
    "draft_decisions",
    "chosen_drafts",
    "draft_misses_added",
)


class SchedulerService:
    def __init__(self, cfg: SchedulerConfig, ctx: zmq.Context | None = None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        self.keys = WireKeys(cfg.wire_keys, "scheduler") if cfg.wire_keys else None
        if self.keys is not None:
            self.keys.start_authenticator(self.ctx)
        api_secure, worker_secure = (self.keys.server("api"), self.keys.server("worker")) if self.keys else (None, None)
        self.router: RouterSocket = RouterSocket(self.ctx, cfg.api_addr, ApiToScheduler, api_secure)
        # steps go to one peer, by identity (the adopted worker's boot id); nothing is read from this socket
        self.steps: RouterSocket = RouterSocket(self.ctx, cfg.steps_addr, None, worker_secure)
        self.results: PeerSocket = PeerSocket(
            self.ctx, zmq.PULL, cfg.results_addr, WorkerToScheduler, bind=True, secure=worker_secure
        )
        self.core: BatchScheduler | None = None
        self.worker_boot: str | None = None
        self.worker = Liveness()
        self.not_ready_reason = "waiting for the worker to report its pools"
        self.expert_hits = self.expert_misses = 0
        self._step_sent_at: float | None = None  # this process's clock: when the step in flight went out
        self._hold_until: float | None = None  # new prompts held for more to arrive until then (arrival_hold_s)
        self._worker_said: tuple[float, int, float] = (
            0.0,
            0,
            0.0,
        )  # (when, last_step, step_running_s) of its last beat
        self._intruders: set[str] = set()  # boot ids of other workers heard while ours is alive (logged once)
        self.apis: dict[bytes, Liveness] = {}
        self.rids: dict[tuple[bytes, int], int] = {}
        # Worker request ids start past any earlier scheduler's, so a worker that outlives a scheduler
        # restart never sees an id twice.
        self._rid = itertools.count(time.time_ns() // 1000)
        self.metrics = SchedulerMetrics()
        self.trace = StepTrace("scheduler")  # FERRY_STEP_TRACE: each step's timeline (bench/profile_serve.py)
        self._landed: Outcome | None = None  # a landed step's outcome not yet told to the api (_step_landed)
        self._preemptions_seen = 0
        self._counters_seen = dict.fromkeys(COUNTED, 0)  # of the current core, exported so far
        self._running = True
        self.boot_id = uuid.uuid4().hex
        # the bench's recorded continuations (FERRY_BENCH_ORACLE_DRAFTS): read at start, a bad file fails it
        oracle = cfg.bench_drafts.oracle_path
        self._oracle_sequences = OracleDrafter.read(oracle) if oracle is not None else None
        self._snapshot: tuple[SchedulerStatus, dict | None] = (self._status(), None)
        self.http = None
        if cfg.health_port is not None:
            self.http = serve_side_http(cfg.health_host, cfg.health_port, self._health, self.metrics.registry)

    # ---- loop ------------------------------------------------------------------------------------

    def stop(self) -> None:
        self._running = False

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router.sock, zmq.POLLIN)
        poller.register(self.results.sock, zmq.POLLIN)
        next_beat = 0.0
        freeze_startup_heap()  # its modules stay out of every full collection (shared/startup_heap.py)
        log.info(
            "scheduler_started",
            api_addr=self.cfg.api_addr,
            steps_addr=self.cfg.steps_addr,
            results_addr=self.cfg.results_addr,
            health_port=self.cfg.health_port,
        )
        while self._running:
            now = time.monotonic()
            if now >= next_beat:
                # woken this late: this process did not read its sockets meanwhile, so that time is
                # not its peers' silence (shared/liveness.py)
                self._heartbeat(late_s=now - next_beat if next_beat else 0.0)
                next_beat = now + HEARTBEAT_INTERVAL_S
            wake = next_beat if self._hold_until is None else min(next_beat, self._hold_until)
            poller.poll(max(1, int((wake - time.monotonic()) * 1000 + 0.999)))
            self._drain_worker()
            self._drain_apis()
            self._maybe_step()
        self.close()

    def close(self) -> None:
        self.trace.flush()
        for s in (self.router, self.steps, self.results):
            s.close()
        if self.keys is not None:
            self.keys.stop()
        if self.http is not None:
            self.http.shutdown()

    def _drain_apis(self) -> None:
        while True:
            try:
                got = self.router.recv()
            except PeerWireError as exc:
                self._refuse_undecodable(exc)
                continue
            if got is None:
                return
            client, msg = got
            if isinstance(msg, ApiHeartbeat) and msg.replica:
                # from the replica's heartbeat thread, on a socket of its own: it speaks for the replica
                self.apis.setdefault(msg.replica.encode(), Liveness()).beat()
                continue
            self.apis.setdefault(client, Liveness()).beat()
            match msg:
                case Submit():
                    if (client, msg.req_id) in self.rids:
                        log.warning(
                            "duplicate_request_id", client=client.decode(errors="replace"), client_req_id=msg.req_id
                        )
                        continue  # the request already running under that id goes on; the copy is dropped
                    self._submit(client, msg)
                case Abort(req_id=req_id):
                    rid = self.rids.get((client, req_id))
                    if rid is not None and self.core is not None:
                        self._emit(self.core.abort(rid))
                case ApiHeartbeat():
                    pass

    def _refuse_undecodable(self, exc: PeerWireError) -> None:
        """An api message that is not a valid ApiToScheduler: logged, and when it names a request id
        that request alone is refused (its replica then answers its client with a 400)."""
        log.error("bad_api_message", client=exc.peer.decode(errors="replace"), error=str(exc))
        try:
            raw = msgspec.msgpack.decode(exc.head)
        except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
            return
        if not isinstance(raw, dict) or raw.get("type") != "Submit":
            return
        req_id = raw.get("req_id")
        if isinstance(req_id, int) and not isinstance(req_id, bool) and 0 <= req_id < 2**63:
            self._send(exc.peer, Failed(req_id=req_id, error_type="InvalidRequest", message=f"invalid request: {exc}"))

    def _drain_worker(self) -> None:
        while True:
            try:
                msg = self.results.recv(block=False)
            except WireError as exc:
                log.error("bad_worker_message", error=str(exc))
                continue
            if msg is None:
                return
            match msg:
                case WorkerAlive():
                    self._worker_alive(msg)
                case StepDone(output=output):
                    landed = time.monotonic()
                    self.trace.add(step=output.step_id, landed=landed)
                    if self.core is not None and self.core.step_in_flight:
                        # since the step was sent, or the one before it landed (a step sent ahead): a drafting
                        # step is sent alone, so for it this is its send to its answer
                        wall = landed - self._step_sent_at if self._step_sent_at is not None else 0.0
                        self._step_landed(self.core.complete(output, wall_s=wall))
                case StepFailed(step_id=step_id, message=message):
                    log.error("step_failed", step_id=step_id, error=message)
                    if self.core is not None and self.core.step_in_flight:
                        self._step_landed(
                            self.core.fail_step(step_id, EngineError(f"the worker failed a step: {message}"))
                        )

    def _step_landed(self, out: Outcome) -> None:
        """After an answer: time the step now due from here (a step scheduled ahead waited behind the
        one that just landed), send the next step, then tell the api replicas. The worker's next step
        is the one thing waiting on this process; the api's tokens can follow it by a step's build."""
        self._step_sent_at = time.monotonic() if self.core is not None and self.core.step_in_flight else None
        self._landed = out
        self._maybe_step()
        self._emit_landed()

    def _emit_landed(self) -> None:
        """The landed step's outcome to the api replicas, once (and always before what a failed send
        fails next, so a client gets its last tokens before its error)."""
        out, self._landed = self._landed, None
        if out is not None:
            self._emit(out)

    def _maybe_step(self) -> None:
        """Send the next step when none is in flight, and then, while one is, the step after it
        (BatchScheduler.schedule_ahead): the worker starts it without waiting for this process."""
        if self.core is None:
            return
        if not self.core.step_in_flight:
            hold = self.core.arrival_hold_s(time.monotonic())
            if hold > 0:  # prompts arriving together share one prefill step (batcher.arrival_hold_s)
                self._hold_until = time.monotonic() + hold
                return
            self._hold_until = None
            batch = self.core.schedule()
            if batch is None or not self._send_step(batch):
                return
        # as many as --schedule-ahead-steps allows: each fed what the one before it samples
        while (batch := self.core.schedule_ahead()) is not None and self._send_step(batch):
            self.metrics.steps_ahead.inc()

    def _send_step(self, batch) -> bool:
        handed = time.monotonic()  # the trace's `sent`: before the send, so the hop counts the send's own time
        if not self.steps.send(self.worker_boot.encode(), RunStep(batch)):
            # every step in flight fails: a step scheduled ahead needs the one before it
            self._emit_landed()
            self._emit(self.core.fail_in_flight(ServiceUnavailable("the worker is not connected")))
            self._step_sent_at = None
            return False
        if self._step_sent_at is None:
            self._step_sent_at = time.monotonic()
        if self.trace.enabled:  # its requests, for a request's own timeline (bench/ttft_path.py)
            self.trace.add(step=batch.step_id, sent=handed, rids=batch.req_ids.tolist())
        self.metrics.steps.inc()
        self.metrics.step_tokens.inc(len(batch.tokens))
        return True

    # ---- requests --------------------------------------------------------------------------------

    def _submit(self, client: bytes, msg: Submit) -> None:
        received = time.monotonic()
        structlog.contextvars.bind_contextvars(client=client.decode(errors="replace"), client_req_id=msg.req_id)
        try:
            if self.core is None:
                raise ServiceUnavailable(f"the server is not ready: {self.not_ready_reason}")
            rid = next(self._rid)
            req = self.core.add(
                rid,
                client,
                msg.req_id,
                np.asarray(msg.prompt_token_ids),
                msg.sampling,
                msg.max_tokens,
                now=time.monotonic(),
            )
        except FerryError as exc:
            if isinstance(exc, InvalidRequest):
                self.metrics.rejected.inc()
            log.info("request_rejected", error=str(exc))
            self._send(
                client, Failed(req_id=msg.req_id, error_type=type(exc).__name__, message=str(exc), param=exc.param)
            )
            return
        finally:
            structlog.contextvars.unbind_contextvars("client", "client_req_id")
        self.rids[(client, msg.req_id)] = rid
        # when prompts reach the scheduler, against the steps: how far apart a burst arrives (arrival_hold_s)
        self.trace.add(
            rid=rid, req=msg.req_id, received=received, arrived=time.monotonic(), prompt_tokens=req.prompt_len
        )
        log.debug("request_queued", rid=rid, prompt_tokens=req.prompt_len, max_tokens=req.max_tokens)

    def _send(self, client: bytes, msg) -> None:
        """To one api replica; a message it cannot take (disconnected right now) is logged, since
        its request then waits on the api side until that replica is declared lost."""
        if not self.router.send(client, msg):
            log.warning("api_message_dropped", client=client.decode(errors="replace"), message=type(msg).__name__)

    def _emit(self, out: Outcome) -> None:
        per_client: dict[bytes, tuple[list[int], list[int], list, list]] = defaultdict(lambda: ([], [], [], []))
        for req, lp in out.prompt_logprobs:  # already under the api's request id
            per_client[req.client][3].append(lp)
        for req, token in out.tokens:
            ids, toks, _, _ = per_client[req.client]
            ids.append(req.client_req_id)
            toks.append(token)
        for req, lp in out.logprobs:
            per_client[req.client][2].append(msgspec.structs.replace(lp, req_id=req.client_req_id))
        for client, (ids, toks, lps, prompt_lps) in per_client.items():
            self._send(
                client,
                Tokens(
                    np.array(ids, dtype=np.int64),
                    np.array(toks, dtype=np.int32),
                    logprobs=tuple(lps),
                    prompt_logprobs=tuple(prompt_lps),
                ),
            )
        for req, reason in out.finished:
            self.rids.pop((req.client, req.client_req_id), None)
            if self.cfg.bench_drafts.record_path:  # the bench records what the oracle will draft
                record_sequence(self.cfg.bench_drafts.record_path, req)
            self._send(
                req.client,
                Finished(
                    req_id=req.client_req_id,
                    reason=reason,
                    prompt_tokens=req.prompt_len,
                    completion_tokens=req.output_len,
                    cached_tokens=req.cached_tokens,
                ),
            )
        for req, err in out.failed:
            self.rids.pop((req.client, req.client_req_id), None)
            self._send(req.client, Failed(req_id=req.client_req_id, error_type=type(err).__name__, message=str(err)))

    # ---- liveness --------------------------------------------------------------------------------

    def _worker_alive(self, msg: WorkerAlive) -> None:
        if self.worker_boot is not None and msg.boot_id != self.worker_boot:
            if self.worker.alive():
                # Another worker (or a peer posing as one) while ours is alive: it gets nothing, and
                # changes nothing. Ours going silent is what lets a restarted worker in.
                if msg.boot_id not in self._intruders and len(self._intruders) < 64:
                    self._intruders.add(msg.boot_id)
                    log.error("second_worker_ignored", boot_id=msg.boot_id[:64], adopted=self.worker_boot)
                return
            if self.core is not None:
                self._worker_lost("the worker restarted")
        self.worker.beat()
        self._worker_said = (time.monotonic(), msg.last_step, msg.step_running_s)
        self.expert_hits, self.expert_misses = msg.expert_hits, msg.expert_misses
        if self.core is not None:  # the cache's miss rate prices the misses drafts add (draft_length.py)
            self.core.draft_length.note_expert_lookups(msg.expert_hits, msg.expert_misses)
        timeout = self.cfg.step_timeout_s
        if msg.step_running_s > timeout:
            # Alive but hung in one step: fail its requests rather than let clients wait forever, and
            # take no new work from it until it reports idle again.
            if self.core is not None:
                self._worker_lost(
                    f"the worker has been running one step for {msg.step_running_s:.0f}s "
                    f"(over --step-timeout {timeout:g}s)"
                )
            return
        if msg.boot_id == self.worker_boot:
            return
        if self.core is not None:
            self._worker_lost("the worker restarted")
        if msg.pool is None:
            self.not_ready_reason = "the worker is loading the model"
            return
        self._adopt_pool(msg.boot_id, msg.pool)

    def _check_step_in_flight(self) -> None:
        """A step this process sent and never heard back about, timed by its own clock: past
        --step-timeout the worker is failed, whatever it reports; a worker that reports itself idle
        without ever having received the step (lost, or taken by another peer) fails the step alone."""
        if self.core is None or not self.core.step_in_flight or self._step_sent_at is None:
            return
        now = time.monotonic()
        waited = now - self._step_sent_at
        if waited > self.cfg.step_timeout_s:
            self._worker_lost(f"the worker did not answer a step within --step-timeout {self.cfg.step_timeout_s:g}s")
            return
        said_at, last_step, running = self._worker_said
        step_id = self.core.in_flight_step
        # step ids only grow: a worker whose last step is this one or a later one (a step scheduled
        # ahead) has received it
        if (
            waited > PEER_TIMEOUT_S
            and said_at - self._step_sent_at > PEER_TIMEOUT_S
            and last_step < step_id
            and running == 0
        ):
            log.error("step_lost", step_id=step_id, worker_last_step=last_step)
            self._step_sent_at = None
            # a step sent after it (scheduled ahead) went the same way
            self._emit(
                self.core.fail_in_flight(
                    ServiceUnavailable(f"the worker never received step {step_id}; the request was lost")
                )
            )

    def _oracle_drafter(self, pool: PoolReport) -> OracleDrafter | None:
        """The bench's oracle drafts (FERRY_BENCH_ORACLE_DRAFTS, oracle_drafter.py); None: prompt lookup."""
        if self._oracle_sequences is None:
            return None
        bench = self.cfg.bench_drafts
        prompts = len(self._oracle_sequences)
        log.warning("bench_oracle_drafts", path=bench.oracle_path, alpha=bench.alpha, prompts=prompts)
        return OracleDrafter(self._oracle_sequences, bench.alpha, pool.vocab_size)

    def _adopt_pool(self, boot_id: str, pool: PoolReport) -> None:
        try:
            # Step ids unique across scheduler restarts: a worker that outlived the previous scheduler
            # may still answer one of its steps, which must not pass for ours.
            self.core = BatchScheduler(
                pool,
                first_step_id=time.time_ns() // 1000,
                prefix_cache=self.cfg.prefix_cache,
                prefill_coalesce_s=self.cfg.prefill_coalesce_s,
                schedule_ahead_steps=self.cfg.schedule_ahead_steps,
                speculative_method=self.cfg.speculative_method,
                speculative_tokens=self.cfg.speculative_tokens,
                drafter=self._oracle_drafter(pool),
                pinned_drafts=self.cfg.bench_drafts.pinned_drafts,
            )
        except ValueError as exc:
            self.not_ready_reason = f"the worker's pool report is unusable: {exc}"
            log.error("bad_pool_report", error=str(exc))
            return
        self.worker_boot = boot_id
        self.not_ready_reason = ""
        self._preemptions_seen = 0
        self._counters_seen = dict.fromkeys(COUNTED, 0)
        log.info(
            "worker_ready",
            boot_id=boot_id,
            kv_pages=pool.kv_pages,
            page_size=pool.page_size,
            linear_state_slots=pool.linear_state_slots,
            linear_state_snapshots=pool.linear_state_snapshots,
            max_running_requests=pool.max_running_requests,
            max_prefill_tokens=pool.max_prefill_tokens,
            max_model_len=pool.max_model_len,
            prefix_cache=self.core.kv.prefix_reuse,
        )

    def _worker_lost(self, why: str) -> None:
        log.error("worker_lost", reason=why)
        core, self.core, self.worker_boot = self.core, None, None
        self._step_sent_at = None
        self._intruders.clear()
        self.not_ready_reason = why
        if core is not None:
            self._emit(core.fail_all(ServiceUnavailable(f"{why}; the request was lost")))

    def _heartbeat(self, late_s: float = 0.0) -> None:
        """Beat first (nothing queued ahead of the beats), then judge the peers on what they sent:
        everything waiting is read before anyone is declared lost, and time this process spent not
        listening (`late_s`) is excused (shared/liveness.py)."""
        status = self._status()
        for client in self.apis:
            self.router.send(client, status)
        if self.worker_boot is not None:
            self.steps.send(self.worker_boot.encode(), SchedulerBeat(boot_id=self.boot_id))
        for live in (self.worker, *self.apis.values()):
            live.excuse(late_s)
        self._drain_worker()
        self._drain_apis()
        self._check_step_in_flight()
        if self.core is not None and not self.worker.alive():
            self._worker_lost(f"the worker stopped responding (no heartbeat for {self.worker.silent_for():.1f}s)")
        elif self.core is None and self.worker.ever_seen and not self.worker.alive() and self.worker_boot is None:
            self.not_ready_reason = f"the worker stopped responding (no heartbeat for {self.worker.silent_for():.1f}s)"
        for client, live in list(self.apis.items()):
            if not live.alive():
                self._api_lost(client, live.silent_for() or 0.0)
        status = self._status()
        self._snapshot = (status, self._pool_dict())
        self._update_metrics(status)

    def _api_lost(self, client: bytes, silent_s: float) -> None:
        """Its requests are aborted, each as a failure (never a normal finish): should the replica still
        be there after all, its clients get an error, not a stream that looks complete."""
        del self.apis[client]
        mine = [rid for (c, _), rid in self.rids.items() if c == client]
        log.warning(
            "api_replica_lost", client=client.decode(errors="replace"), aborted=len(mine), silent_s=round(silent_s, 1)
        )
        if self.core is None:
            for key in [k for k in self.rids if k[0] == client]:
                del self.rids[key]
            return
        err = ServiceUnavailable(
            f"the scheduler heard nothing from this api replica for {silent_s:.1f}s and aborted its requests"
        )
        for key in [k for k in self.rids if k[0] == client]:
            if self.rids[key] in self.core.by_rid:
                self._emit(self.core.abort(self.rids[key], err))  # pops the key, now or when its step lands
            else:
                del self.rids[key]

    def _status(self) -> SchedulerStatus:
        c = self.core
        if c is None:
            return SchedulerStatus(boot_id=self.boot_id, ready=False, reason=self.not_ready_reason)
        return SchedulerStatus(
            boot_id=self.boot_id,
            ready=True,
            reason="",
            max_model_len=c.pool.max_model_len,
            running=len(c.running),
            waiting=len(c.waiting),
            kv_pages_total=c.kv.total,
            kv_pages_available=c.kv.available,
            kv_pages_cached=c.kv.cache.nodes,
            expert_hits=self.expert_hits,
            expert_misses=self.expert_misses,
            preemptions=c.preemptions,
            prefix_hits=c.prefix_hits,
            snapshot_evictions=c.snapshots.evictions,
            state_snapshots=c.snapshots.held,
            draft_rows=c.draft_rows,
            drafted_tokens=c.drafted_tokens,
            accepted_drafts=c.accepted_drafts,
            draft_decisions=c.draft_length.decisions,
            chosen_drafts=c.draft_length.chosen_drafts,
            draft_misses_added=int(c.draft_length.estimated_misses_added),
            draft_decode_step_s=c.draft_length.decode_step_s or 0.0,
            draft_chain_position_s=c.draft_length.chain_position_s or 0.0,
            draft_verify_step_s=c.draft_length.verify_step_s or 0.0,
            draft_verify_wall_s=c.draft_length.verify_wall_s or 0.0,
        )

    def _update_metrics(self, s: SchedulerStatus) -> None:
        m = self.metrics
        m.worker_ready.set(1 if s.ready else 0)
        m.status.set_from(s)
        m.kv_cached.set(s.kv_pages_cached)
        if s.preemptions > self._preemptions_seen:
            m.preemptions.inc(s.preemptions - self._preemptions_seen)
            self._preemptions_seen = s.preemptions
        m.state_snapshots.set(s.state_snapshots)
        for name in COUNTED:
            value, counter = getattr(s, name), getattr(m, name)
            if value > self._counters_seen[name]:
                counter.inc(value - self._counters_seen[name])
                self._counters_seen[name] = value

    def _pool_dict(self) -> dict | None:
        if self.core is None:
            return None
        return {f: getattr(self.core.pool, f) for f in self.core.pool.__struct_fields__}

    def _health(self) -> tuple[bool, dict]:
        """Called from the side-HTTP thread: reads only the snapshot the loop replaces every heartbeat."""
        s, pool = self._snapshot
        silent = self.worker.silent_for()
        body = {
            "status": "ready" if s.ready else "unavailable",
            "reason": s.reason,
            "pool": pool,
            "peers": {
                "worker": "ready"
                if s.ready
                else ("silent" if silent is None or silent > PEER_TIMEOUT_S else "not ready"),
                "api_replicas": len(self.apis),
            },
        }
        return s.ready, body
