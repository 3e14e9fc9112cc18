"""Issue 22, 3: a busy process is never declared lost, and no request is aborted because one was slow to
say it is alive (shared/liveness.py). A worker in one long step still hears its scheduler; an api
replica whose event loop stalls keeps its streams; and a soak on a busy 2-core host (16 streams on the
real tiny model beside 4 processes burning CPU) ends with every request whole and no peer declared
lost. Loopback and ipc only."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import signal
import sys
import threading
import time

import aiohttp
import openai
import pytest

from tests.integration.harness import (
    REAL_WORKER_ENV,
    api_command,
    http_get,
    make_model_dir,
    start_cluster,
    stream_concurrently,
)

LOST_EVENTS = ("api_replica_lost", "worker_lost", "stopped responding", "step_lost")


def _lost_lines(c) -> list[str]:
    return [line[:300] for name in c.procs for line in c.log(name).splitlines() if any(e in line for e in LOST_EVENTS)]


class _HealthWatch:
    """Polls each /health every 0.1 s in a thread; `bad` holds (seconds, process, status, body) of each
    answer that was not a 200."""

    def __init__(self, ports: dict[str, int]):
        self.ports, self.bad, self._stop = ports, [], threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for name, port in self.ports.items():
                try:
                    status, body = http_get(f"http://127.0.0.1:{port}/health", timeout=5)
                except OSError as exc:
                    status, body = -1, str(exc)
                if status != 200:
                    self.bad.append((round(time.monotonic() - self._t0, 1), name, status, body[:200]))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def long_step_model_dir(tmp_path, tiny_tokenizer_dir, tiny_tokenizer):
    """Every step takes 4 s: longer than the 2.5 s in which a silent peer is lost."""
    return make_model_dir(tiny_tokenizer_dir, tmp_path / "long-step", tiny_tokenizer, step_delay_s=4.0)


def test_a_worker_busy_in_one_long_step_still_hears_its_scheduler(long_step_model_dir, tmp_path):
    """The worker reads its scheduler's beats between steps; a 4 s step is its own business, not the
    scheduler's silence: its /health stays ready, and the request finishes."""
    c = start_cluster(long_step_model_dir, tmp_path / "run", worker_flags=["--max-model-len", "256"])
    try:
        result: list = []
        client = openai.OpenAI(base_url=c.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        t = threading.Thread(
            target=lambda: result.append(client.completions.create(model="tiny", prompt="one long step", max_tokens=1))
        )
        with _HealthWatch({"worker": c.worker_health_port, "scheduler": c.scheduler_health_port}) as watch:
            t.start()
            t.join(20)
        assert result and result[0].usage.completion_tokens == 1 and result[0].choices[0].finish_reason == "length"
        assert watch.bad == [], watch.bad
        assert _lost_lines(c) == []
    finally:
        c.stop()


def test_an_api_replica_whose_event_loop_stalls_keeps_its_streams(slow_model_dir, tmp_path):
    """The api's event loop stands still for 3.5 s (tests/doubles/stalling_api.py) while four streams
    run: its beats come from a thread of their own, so the scheduler aborts nothing, and the api does
    not blame the scheduler for the time it did not listen. Every stream ends whole, with "length"."""
    c = start_cluster(slow_model_dir, tmp_path / "run", worker_flags=["--max-model-len", "512"], wait=False)
    try:
        c.procs["api"].kill()
        c.procs["api"].wait()
        cmd = api_command(slow_model_dir, c.api_addr, c.port)
        c.launch("api", [sys.executable, "-m", "tests.doubles.stalling_api", *cmd[4:]], {"STALL_S": "3.5"})
        c.wait_ready()
        results: list = []
        t = threading.Thread(
            target=lambda: results.append(
                stream_concurrently(c.base_url, [(f"stream {i} through a stall", 300) for i in range(4)])
            )
        )
        t.start()
        time.sleep(1.0)  # the streams are generating
        c.procs["api"].send_signal(signal.SIGUSR1)
        t.join(60)
        assert not t.is_alive(), "streams hung"
        assert "event loop stalled 3.5s" in c.log("api")
        assert results and [(usage, reason) for _, usage, reason in results[0]] == [(300, "length")] * 4, results
        assert _lost_lines(c) == []
    finally:
        c.stop()


# ---- the soak: a busy 2-core host --------------------------------------------------------------------

# LOAD_S: six of the 2.5 s windows in which a silent peer is lost (shared/liveness.py), each stream's rounds all
# started under the burners' full load; a longer soak burns the suite's shared cores without a new case
STREAMS, BURNERS, LOAD_S = 16, 4, 15.0


def _burn() -> None:
    while True:
        pass


async def _streams_until(url: str, deadline: float) -> dict[str, int]:
    """STREAMS clients, each streaming 120-token completions one after another until `deadline`;
    {outcome: count}: "whole" for a stream that ended with "length" after all its tokens."""
    counts: dict[str, int] = {}

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            body = {
                "model": "tiny",
                "prompt": f"soak {i} round {n}",
                "max_tokens": 120,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
                "stream_options": {"include_usage": True},
            }
            outcome = "no finish"
            try:
                async with session.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        outcome = f"status {r.status}"
                    else:
                        reason, usage = None, None
                        async for line in r.content:
                            if not line.startswith(b"data: {"):
                                continue
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                reason = "error: " + chunk["error"]["message"][:100]
                            elif chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                                reason = chunk["choices"][0]["finish_reason"]
                            if chunk.get("usage"):
                                usage = chunk["usage"]["completion_tokens"]
                        outcome = "whole" if (reason, usage) == ("length", 120) else f"{reason} after {usage}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                outcome = type(exc).__name__
            counts[outcome] = counts.get(outcome, 0) + 1
            n += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(one(session, i) for i in range(STREAMS)))
    return counts


@pytest.mark.slow
def test_a_soak_beside_cpu_burners_aborts_nothing_and_declares_no_peer_lost(tiny_models, tmp_path):
    c = start_cluster(
        tiny_models["qwen3_moe"],
        tmp_path / "run",
        worker_flags=["--device", "cpu", "--max-model-len", "512"],
        boot="ferry.services.worker.boot:boot_worker",
        worker_env=REAL_WORKER_ENV,
    )
    burners = [multiprocessing.get_context("fork").Process(target=_burn, daemon=True) for _ in range(BURNERS)]
    try:
        for b in burners:
            b.start()
        ports = {"api": c.port, "worker": c.worker_health_port, "scheduler": c.scheduler_health_port}
        with _HealthWatch(ports) as watch:
            counts = asyncio.run(_streams_until(c.base_url, time.monotonic() + LOAD_S))
        figures = {"outcomes": counts, "health_not_ready": watch.bad[:10], "lost": _lost_lines(c)[:10]}
        print("soak beside burners:", json.dumps(figures))
        assert set(counts) == {"whole"} and counts["whole"] >= STREAMS, figures
        assert watch.bad == [] and figures["lost"] == [], figures
    finally:
        for b in burners:
            b.terminate()
            b.join(5)
        c.stop()
