"""The soak: a few hundred requests, 48 at a time, a fifth of them abandoned mid-way by their client,
against the real api, scheduler and worker (the PagedHashModel double) with a KV pool small enough to
preempt. Every request that stays gets all its tokens, none hangs, and at the end every KV page is
free again. Bounded: 300 requests, each with a 30 s limit, the whole under two minutes on CI.

The figures go to stdout and to soak.json in the test's directory (`pytest -s` shows them)."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp

from tests.integration.harness import eventually, http_get, start_cluster

REQUESTS, CONCURRENCY, DISCONNECT_RATE = 300, 48, 0.2


async def _one(session: aiohttp.ClientSession, url: str, i: int, rng: random.Random) -> str:
    """One request: a stayer reads its whole answer; a leaver (DISCONNECT_RATE of them) streams a long
    answer, reads a few chunks (or none: it leaves while queued) and closes its connection."""
    leaves_after = rng.randint(0, 8) if rng.random() < DISCONNECT_RATE else None
    n = rng.randint(80, 140) if leaves_after is not None else rng.randint(1, 40)
    body = {
        "model": "tiny",
        "prompt": f"soak {i} " * rng.randint(1, 12),
        "max_tokens": n,
        "ignore_eos": True,
        "stream": leaves_after is not None or rng.random() < 0.7,
        "temperature": 0,
    }

    async def run() -> str:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return f"status {r.status}"
            if not body["stream"]:
                got = (await r.json())["usage"]["completion_tokens"]
                return "ok" if got == n else f"{got} of {n} tokens"
            chunks = 0
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunks += 1
                    if leaves_after is not None and chunks > leaves_after:
                        return "disconnected"  # leaving the `async with` closes the connection mid-stream
            return "ok" if chunks >= 1 and leaves_after is None else f"finished after {chunks} chunks"

    try:
        if leaves_after == 0:  # gone before its first token
            task = asyncio.ensure_future(run())
            await asyncio.sleep(rng.uniform(0.0, 0.05))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return "disconnected"
        return await asyncio.wait_for(run(), 30)
    except asyncio.TimeoutError:
        return "hung"


async def _soak(url: str) -> dict:
    rng = random.Random(13)
    sem = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def guarded(i):
            async with sem:
                return await _one(session, url, i, rng)

        outcomes = await asyncio.gather(*(guarded(i) for i in range(REQUESTS)))
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return counts


def test_soak_with_random_disconnects_ends_with_every_page_free(model_dir, tmp_path):
    c = start_cluster(model_dir, tmp_path, worker_flags=["--max-model-len", "256", "--num-pages", "48"])
    try:
        counts = asyncio.run(asyncio.wait_for(_soak(c.base_url), 240))

        def pool() -> dict:
            return json.loads(http_get(f"http://127.0.0.1:{c.scheduler_health_port}/health")[1])

        def status() -> dict:
            s = http_get(f"http://127.0.0.1:{c.scheduler_health_port}/metrics")[1]
            return {
                line.split()[0]: float(line.split()[1])
                for line in s.splitlines()
                if line.startswith(
                    (
                        "ferry_scheduler_kv_pages",
                        "ferry_scheduler_running",
                        "ferry_scheduler_waiting",
                        "ferry_scheduler_preemptions_total",
                    )
                )
            }

        total = pool()["pool"]["kv_pages"]
        settled = eventually(
            lambda: (
                lambda s: (
                    s
                    if s.get("ferry_scheduler_kv_pages_available") == total
                    and s.get("ferry_scheduler_running_requests") == 0
                    else None
                )
            )(status()),
            timeout=30,
        )
        figures = {
            "requests": REQUESTS,
            "concurrency": CONCURRENCY,
            "outcomes": counts,
            "disconnects": counts.get("disconnected", 0),
            "hangs": counts.get("hung", 0),
            "kv_pages_total": total,
            "kv_pages_free_at_end": (settled or status()).get("ferry_scheduler_kv_pages_available"),
            "preemptions": (settled or status()).get("ferry_scheduler_preemptions_total"),
        }
        print("soak:", json.dumps(figures))
        (tmp_path / "soak.json").write_text(json.dumps(figures))
        assert counts.get("hung", 0) == 0, figures
        assert set(counts) <= {"ok", "disconnected"}, figures
        assert counts.get("disconnected", 0) >= REQUESTS * DISCONNECT_RATE / 2, figures
        assert settled is not None, figures
        assert c.procs["scheduler"].poll() is None and c.procs["worker"].poll() is None
    finally:
        c.stop()
