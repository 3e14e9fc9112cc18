"""Each process freezes the heap it built to start (shared/startup_heap.py), so no full collection walks the
booted model, the tokenizer or the modules while it serves: the worker before it reports its pool (no step can
arrive before), its expert-parallel followers before they follow, the scheduler before its loop, the api once it
listens. The freezes are spied here, not done: the test process's own heap is left as it is."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import threading

from tests.integration.harness import FAKE_BOOT, free_port


def test_freezing_leaves_the_heap_out_of_full_collections():
    from ferry.shared.startup_heap import freeze_startup_heap

    frozen = gc.get_freeze_count()
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()


def test_the_worker_freezes_its_booted_heap_before_it_reports_its_pool(tmp_path, monkeypatch):
    from ferry.services.worker import service
    from ferry.services.worker.flags import WorkerBootConfig

    (tmp_path / "paged_hash_model.json").write_text(json.dumps({"vocab": list(range(5, 20))}))
    cfg = service.WorkerConfig(
        steps_addr=f"ipc://{tmp_path}/steps",
        results_addr=f"ipc://{tmp_path}/results",
        health_host="127.0.0.1",
        health_port=None,
        boot=FAKE_BOOT,
    )
    worker = service.WorkerService(cfg, WorkerBootConfig(model=str(tmp_path)))
    reported_at_freeze = []
    monkeypatch.setattr(service, "freeze_startup_heap", lambda: reported_at_freeze.append(worker.heartbeat.pool))
    try:
        worker.boot()
    finally:
        worker.close()
    assert reported_at_freeze == [None] and worker.heartbeat.pool is not None


def test_the_scheduler_freezes_its_heap_before_its_loop(tmp_path, monkeypatch):
    import zmq

    from ferry.services.scheduler import service
    from ferry.services.scheduler.config import SchedulerConfig

    cfg = SchedulerConfig(
        api_addr=f"ipc://{tmp_path}/api",
        steps_addr=f"ipc://{tmp_path}/steps",
        results_addr=f"ipc://{tmp_path}/results",
        health_host="127.0.0.1",
        health_port=None,
        step_timeout_s=60,
    )
    scheduler = service.SchedulerService(cfg, zmq.Context())
    frozen = []
    monkeypatch.setattr(service, "freeze_startup_heap", lambda: (frozen.append(True), scheduler.stop()))
    unfrozen = threading.Timer(5.0, scheduler.stop)  # without the freeze the loop would run on: stopped anyway
    unfrozen.start()
    try:
        scheduler.run()  # the spy stops it: the loop ends at once
    finally:
        unfrozen.cancel()
    assert frozen == [True]


def test_the_api_freezes_its_heap_once_it_listens(tiny_tokenizer_dir, tmp_path, monkeypatch):
    from ferry.services.api import app
    from ferry.services.api.config import ApiConfig

    cfg = ApiConfig(
        host="127.0.0.1",
        port=free_port(),
        scheduler_addr=f"ipc://{tmp_path}/api.sock",
        tokenizer=str(tiny_tokenizer_dir),
        served_model_name="tiny",
        api_key=None,
        max_body_bytes=2**20,
        identity="api-heap-test",
        drain_timeout_s=1.0,
    )
    frozen = []

    def spy() -> None:  # listening, its signal handlers set: a SIGTERM drains and stops it, as a user's would
        frozen.append(True)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(app, "freeze_startup_heap", spy)
    try:
        asyncio.run(asyncio.wait_for(app.serve(cfg), 10))
    except TimeoutError:
        pass  # it never froze, and never stopped: the assertion says so
    assert frozen == [True]
