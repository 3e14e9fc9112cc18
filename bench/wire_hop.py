"""One hop of the wire between two processes, as the scheduler and the worker use it: a decode step's
RunStep (built, encoded, sent, polled for, received and decoded) and a StepDone back, timed from the
sender's clock before it builds the message to the receiver's after it decodes (time.monotonic, one
clock for both processes). Messages are sent 1.5 ms apart, about a served step, so the receiver sleeps
in its poll between them as the real loops do.

    python3 bench/wire_hop.py --messages 2000 --rows 1 --pages 70
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferry.shared.messages import RunStep, SchedulerToWorker, StepDone, WorkerToScheduler  # noqa: E402
from ferry.shared.step import StepBatch, StepOutput  # noqa: E402
from ferry.shared.wire import PeerSocket  # noqa: E402


def _receive(addr: str, union, n: int, sent_at, queue) -> None:
    ctx = zmq.Context()
    sock = PeerSocket(ctx, zmq.PULL, addr, union, bind=True)
    poller = zmq.Poller()
    poller.register(sock.sock, zmq.POLLIN)
    hops = []
    while len(hops) < n:
        poller.poll(500)
        while (msg := sock.recv(block=False)) is not None:
            hops.append(time.monotonic() - sent_at(msg))
    queue.put(hops)


def _step(rows: int, pages: int, stamp: float) -> RunStep:
    return RunStep(
        StepBatch(
            step_id=int(stamp * 1e9),
            req_ids=np.arange(rows, dtype=np.int64),
            tokens=np.zeros(rows, np.int32),
            query_lens=np.ones(rows, np.int32),
            context_lens=np.full(rows, pages * 16 - 8, np.int32),
            page_table=np.arange(rows * pages, dtype=np.int32).reshape(rows, pages) + 1,
            linear_state_slots=np.arange(1, rows + 1, dtype=np.int32),
            reset_linear_state=np.zeros(rows, bool),
            sample=np.ones(rows, bool),
            feed_sampled=np.ones(rows, bool),
        )
    )


def _done(rows: int, stamp: float) -> StepDone:
    return StepDone(
        StepOutput(
            step_id=int(stamp * 1e9),
            req_ids=np.arange(rows, dtype=np.int64),
            token_ids=np.ones(rows, np.int32),
            logprobs=np.zeros(rows, np.float32),
        )
    )


def _stamp_of_step(msg) -> float:
    return msg.batch.step_id / 1e9


def _stamp_of_done(msg) -> float:
    return msg.output.step_id / 1e9


def hop(kind: str, n: int, rows: int, pages: int) -> dict:
    union, stamp_of = (SchedulerToWorker, _stamp_of_step) if kind == "RunStep" else (WorkerToScheduler, _stamp_of_done)
    addr = f"ipc://{tempfile.mkdtemp(prefix='ferry-hop-')}/hop.sock"
    queue: mp.Queue = mp.Queue()
    receiver = mp.Process(target=_receive, args=(addr, union, n, stamp_of, queue))
    receiver.start()
    time.sleep(0.5)
    ctx = zmq.Context()
    sock = PeerSocket(ctx, zmq.PUSH, addr, None, bind=False)
    time.sleep(0.3)
    for _ in range(n):
        now = time.monotonic()
        sock.send(_step(rows, pages, now) if kind == "RunStep" else _done(rows, now))
        time.sleep(0.0015)
    hops = sorted(queue.get())
    receiver.join()
    sock.close()
    ctx.term()
    return {"median_ms": round(1e3 * statistics.median(hops), 3), "p90_ms": round(1e3 * hops[int(0.9 * len(hops))], 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--pages", type=int, default=70, help="page-table columns of the step (70: a 1k-token context)")
    args = p.parse_args()
    out = {kind: hop(kind, args.messages, args.rows, args.pages) for kind in ("RunStep", "StepDone")}
    print(json.dumps({"rows": args.rows, "pages": args.pages, **out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
