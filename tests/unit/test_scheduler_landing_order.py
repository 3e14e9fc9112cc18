"""When a step lands the scheduler sends the next step first and tells the api second (the worker's next
step is what waits on it), and a send that fails because the worker is gone never puts the failure of the
requests ahead of the tokens of the step that just landed."""

from __future__ import annotations

import numpy as np
import zmq

from ferry.services.scheduler.batcher import BatchScheduler
from ferry.services.scheduler.config import SchedulerConfig
from ferry.services.scheduler.service import SchedulerService
from ferry.shared.messages import PoolReport
from ferry.shared.sampling import SamplingParams
from ferry.shared.step import StepOutput


def service(tmp_path, worker_connected: bool) -> SchedulerService:
    cfg = SchedulerConfig(
        api_addr=f"ipc://{tmp_path}/api",
        steps_addr=f"ipc://{tmp_path}/steps",
        results_addr=f"ipc://{tmp_path}/results",
        health_host="127.0.0.1",
        health_port=None,
        step_timeout_s=60,
    )
    svc = SchedulerService(cfg, zmq.Context())
    svc.core = BatchScheduler(
        PoolReport(
            kv_pages=64,
            page_size=4,
            linear_state_slots=0,
            max_running_requests=4,
            max_prefill_tokens=64,
            max_model_len=128,
            vocab_size=1000,
        )
    )
    svc.worker_boot = "w"
    events: list = []
    svc._emit = lambda out: events.append(("emit", [t for _, t in out.tokens], [r.rid for r, _ in out.failed]))
    real_send = svc.steps.send

    def send(who: bytes, msg) -> bool:
        events.append(("send", msg.batch.step_id))
        return worker_connected and (real_send(who, msg) or True)  # no DEALER connects here: queued is enough

    svc.steps.send = send
    svc.events = events
    return svc


def land_first_step(svc: SchedulerService) -> None:
    svc.core.add(1, b"api", 7, np.array([5, 6, 7], np.int64), SamplingParams(ignore_eos=True), 10)
    batch = svc.core.schedule()
    svc.events.clear()
    out = StepOutput(
        step_id=batch.step_id,
        req_ids=batch.req_ids,
        token_ids=np.array([42], np.int32),
        logprobs=np.zeros(1, np.float32),
    )
    svc._step_landed(svc.core.complete(out))


def test_the_next_step_leaves_before_the_api_hears_the_landed_tokens(tmp_path):
    svc = service(tmp_path, worker_connected=True)
    land_first_step(svc)
    kinds = [e[0] for e in svc.events]
    assert kinds[0] == "send" and kinds[-1] == "emit" and svc.events[-1][1] == [42]
    svc.close()


def test_a_failed_send_tells_the_landed_tokens_before_the_failure(tmp_path):
    svc = service(tmp_path, worker_connected=False)
    land_first_step(svc)
    emits = [e for e in svc.events if e[0] == "emit"]
    assert emits[0][1] == [42] and emits[0][2] == []  # the landed step's token first
    assert emits[1][2] == [1]  # then the request fails: the worker is not connected
    assert len(emits) == 2  # and the landed outcome is told once
    svc.close()
