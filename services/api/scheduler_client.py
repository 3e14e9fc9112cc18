"""An api replica's link to the scheduler: one DEALER, one reader task fanning messages out to
per-request queues, and heartbeats both ways.

If the scheduler falls silent for PEER_TIMEOUT_S every request in flight fails with 503 and
/health turns 503; nothing waits forever. What clients read (503s, /health's reason) says "the
scheduler", never its address: an ipc address is a path in the private socket directory. This
replica's own beats go out from a thread with a socket of its own, so a busy event loop never makes
it look lost to the scheduler; and time this loop spent not reading (woken late, messages waiting
unread) is not the scheduler's silence (shared/liveness.py).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass

import numpy as np
import structlog
import zmq
import zmq.asyncio

from ferry.shared.contract import logprobs_problem, token_ids_problem
from ferry.shared.errors import EngineError, FerryError, ServiceUnavailable, error_from_wire
from ferry.shared.liveness import HEARTBEAT_INTERVAL_S, Liveness
from ferry.shared.messages import (
    FINISH_REASONS,
    Abort,
    ApiHeartbeat,
    Failed,
    Finished,
    SchedulerStatus,
    SchedulerToApi,
    Submit,
    Tokens,
)
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import Logprobs
from ferry.shared.step_trace import StepTrace
from ferry.shared.wire import AsyncDealer, PeerSocket, WireError
from ferry.shared.wire_keys import require_keys_for_tcp

log = structlog.get_logger("api.scheduler_client")


@dataclass
class Token:
    token_id: int
    at: float  # time.perf_counter() when it arrived
    logprobs: Logprobs | None = None  # for a request that asked


@dataclass
class PromptLogprobs:
    """Log-probabilities of some of the prompt's tokens (completions' echo); they come before any Token."""

    logprobs: Logprobs


Event = Token | PromptLogprobs | Finished | FerryError


class RequestStream:
    """The events of one request: Token*, then Finished or a FerryError."""

    def __init__(self, req_id: int):
        self.req_id = req_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.done = False
        self.traced_first_token = False  # FERRY_STEP_TRACE: its first token's arrival is written once

    async def next(self) -> Event:
        ev = await self.queue.get()
        if not isinstance(ev, (Token, PromptLogprobs)):
            self.done = True
        return ev


class SchedulerClient:
    def __init__(self, addr: str, identity: str, secure=None, vocab_size: int = 0):
        """`secure`: the CURVE setup of the DEALER (shared/wire_keys.py), None without keys; `vocab_size`:
        token ids the scheduler sends must be below it (0: unchecked)."""
        require_keys_for_tcp("--scheduler-addr", addr, secure)
        self.addr = addr
        self.identity = identity
        self.vocab_size = vocab_size
        self.ctx = zmq.asyncio.Context()
        self.dealer: AsyncDealer = AsyncDealer(self.ctx, addr, SchedulerToApi, identity.encode(), secure)
        self._beats = _BeatThread(addr, identity, secure)
        self.status: SchedulerStatus | None = None
        self.scheduler = Liveness()
        self.streams: dict[int, RequestStream] = {}
        self._ids = itertools.count(1)
        self._stopped: FerryError | None = None  # stop_all's error: later submits are refused with it
        self._tasks: list[asyncio.Task] = []
        self._started = time.monotonic()
        # FERRY_STEP_TRACE: when each request went to the scheduler and its tokens came back (bench/ttft_path.py)
        self.trace = StepTrace("api")

    async def start(self) -> None:
        self._beats.start()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._beats.stop()
        self.trace.flush()
        self.dealer.close()
        self.ctx.term()

    # ---- readiness ---------------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        """(ready, why not): the reason goes to clients, so it names no address."""
        if not self.scheduler.alive():
            silent = self.scheduler.silent_for()
            if silent is None:
                return False, "no contact with the scheduler yet"
            return False, f"the scheduler stopped responding ({silent:.1f}s without a heartbeat)"
        if self.status is None or not self.status.ready:
            return False, self.status.reason if self.status else "waiting for the scheduler's status"
        return True, ""

    # ---- requests ----------------------------------------------------------------------------------

    async def submit(self, prompt: list[int], sampling: SamplingParams, max_tokens: int | None) -> RequestStream:
        if self._stopped is not None:
            raise ServiceUnavailable(str(self._stopped))
        ready, why = self.readiness()
        if not ready:  # refused here, at once: the scheduler would refuse it too
            raise ServiceUnavailable(why)
        stream = RequestStream(next(self._ids))
        self.streams[stream.req_id] = stream
        submit_at = time.monotonic()  # the trace's: before the Submit is encoded and sent
        sent = await self.dealer.send(
            Submit(
                req_id=stream.req_id,
                prompt_token_ids=np.asarray(prompt, dtype=np.int32),
                sampling=sampling,
                max_tokens=max_tokens,
            )
        )
        if not sent:
            self.streams.pop(stream.req_id, None)
            raise ServiceUnavailable("the scheduler is not connected")
        self.trace.add(req=stream.req_id, submit=submit_at, prompt_tokens=len(prompt))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Fire and forget (callable from a cancelled handler's cleanup): the scheduler frees the
        request's pages as soon as it reads this."""
        self.streams.pop(stream.req_id, None)
        if stream.done:
            return
        stream.done = True
        # With NOBLOCK the future is already resolved; zmq.Again in it means the scheduler is gone, and
        # with it the request: nothing to abort. The callback only marks that exception as seen.
        fut = self.dealer.sock.send_multipart(
            self.dealer.codec.encode(Abort(stream.req_id)), copy=False, flags=zmq.NOBLOCK
        )
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def stop_all(self, error: FerryError) -> None:
        """End every request in flight with `error` and abort each at the scheduler, which stops
        generating for it (a replica shutting down); a request submitted later is refused with it."""
        self._stopped = error
        for stream in list(self.streams.values()):
            stream.queue.put_nowait(error)
            self.abort(stream)

    def _on_tokens(self, msg: Tokens, now: float) -> None:
        """A step's tokens (and any logprobs) to their streams. A message that breaks the contract (token
        ids of the wrong shape or sign, logprobs of the wrong shapes or ids) fails the requests it names,
        not the replica: nothing of it reaches a client."""
        ids, toks = msg.req_ids, msg.token_ids
        problem = token_ids_problem("token_ids", toks, self.vocab_size)
        if problem is None and not (ids.dtype.kind in "iu" and ids.ndim == 1 and len(ids) == len(toks)):
            problem = "Tokens: req_ids do not match token_ids"
        for lp in (*msg.logprobs, *msg.prompt_logprobs):
            if problem is None:
                problem = logprobs_problem(lp, self.vocab_size)
        if problem is not None:
            log.error("bad_scheduler_message", error=problem)
            named = (ids.tolist() if ids.ndim == 1 else []) + [
                lp.req_id for lp in (*msg.logprobs, *msg.prompt_logprobs)
            ]
            for rid in named:
                if (s := self.streams.pop(rid, None)) is not None:
                    s.queue.put_nowait(EngineError(f"the scheduler sent an unusable token: {problem}"))
            return
        for lp in msg.prompt_logprobs:
            if (s := self.streams.get(lp.req_id)) is not None:
                s.queue.put_nowait(PromptLogprobs(lp))
        lps = {lp.req_id: lp for lp in msg.logprobs}
        for rid, tok in zip(ids.tolist(), toks.tolist()):
            if (s := self.streams.get(rid)) is not None:
                if self.trace.enabled and not s.traced_first_token:  # a request's first token only: not every step's
                    s.traced_first_token = True
                    self.trace.add(req=rid, first_token=time.monotonic())
                s.queue.put_nowait(Token(tok, now, lps.get(rid)))

    # ---- background --------------------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            try:
                msg = await self.dealer.recv()
            except WireError as exc:
                log.error("bad_scheduler_message", error=str(exc))
                continue
            now = time.perf_counter()
            match msg:
                case Tokens():
                    self._on_tokens(msg, now)
                case Finished(req_id=rid):
                    if (s := self.streams.pop(rid, None)) is not None:
                        s.queue.put_nowait(_finish_event(msg))
                case Failed(req_id=rid, error_type=kind, message=text, param=param):
                    if (s := self.streams.pop(rid, None)) is not None:
                        s.queue.put_nowait(error_from_wire(kind, text, param))
                case SchedulerStatus():
                    if self.status is not None and self.status.boot_id != msg.boot_id:
                        self._fail_all("the scheduler restarted")
                    self.status = msg
            if self.status is not None:
                self.scheduler.beat()  # anything it sends says its loop runs (once it has said who it is)

    async def _watch(self) -> None:
        """Fail every request once the scheduler has been silent PEER_TIMEOUT_S of this loop's listening:
        not while messages wait unread (the reader is behind, not the scheduler), and not for the time
        this loop itself did not run (it woke late)."""
        due = time.monotonic() + HEARTBEAT_INTERVAL_S
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            self.scheduler.excuse(now - due)
            due = now + HEARTBEAT_INTERVAL_S
            unread = self.dealer.sock.get(zmq.EVENTS) & zmq.POLLIN
            if self.streams and self.scheduler.ever_seen and not unread and not self.scheduler.alive():
                self._fail_all(self.readiness()[1])

    def _fail_all(self, why: str) -> None:
        err = ServiceUnavailable(f"{why}; the request was lost")
        for s in self.streams.values():
            s.queue.put_nowait(err)
        self.streams.clear()


def _finish_event(msg: Finished) -> Finished | FerryError:
    """A request that finished (stop, length) ends normally. One the scheduler aborted while this replica
    still waits for it (this replica forgets a request before it asks for an abort) did not finish: it
    ends in an error its client sees, never in a normal-looking stop."""
    if msg.reason in ("stop", "length"):
        return msg
    if msg.reason in FINISH_REASONS:
        return ServiceUnavailable(
            f"the scheduler aborted the request after {msg.completion_tokens} tokens, before it finished"
        )
    return EngineError(f"unknown finish reason {msg.reason[:40]!r}")


class _BeatThread(threading.Thread):
    """This replica's ApiHeartbeat every HEARTBEAT_INTERVAL_S, from a thread and a socket of its own (a
    sync one: a ZeroMQ socket belongs to one thread), naming the replica's main socket."""

    def __init__(self, addr: str, identity: str, secure):
        super().__init__(name="api-heartbeat", daemon=True)
        self.identity = identity
        self.ctx = zmq.Context()
        self.sock = PeerSocket(
            self.ctx, zmq.DEALER, addr, None, bind=False, identity=f"{identity}/beat".encode(), secure=secure
        )
        self.sock.sock.setsockopt(zmq.IMMEDIATE, 1)  # beats go to a live scheduler, never into a backlog
        self.sock.sock.setsockopt(zmq.SNDHWM, 4)
        self.stopped = threading.Event()

    def run(self) -> None:
        beat = ApiHeartbeat(replica=self.identity)
        while True:
            self.sock.send(beat, block=False)
            if self.stopped.wait(HEARTBEAT_INTERVAL_S):
                break
        self.sock.close()

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=2)  # it closes its socket as it ends
        else:  # never started
            self.sock.close()
        if not self.is_alive():
            self.ctx.term()
