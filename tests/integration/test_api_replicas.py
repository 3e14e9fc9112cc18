"""Several api replicas share one scheduler (each DEALER has its own identity); a replica that dies
has its requests aborted by the scheduler, which frees their pages."""

from __future__ import annotations

import signal
import threading

import openai

from tests.doubles.paged_model import reference_continuation
from tests.integration.harness import (
    api_command,
    ascii_word_tokens,
    eventually,
    free_port,
    http_get,
    metric,
    start_cluster,
)


def test_two_replicas_serve_together_and_a_dead_replicas_requests_are_freed(slow_model_dir, tmp_path, tiny_tokenizer):
    c = start_cluster(slow_model_dir, tmp_path, worker_flags=["--max-model-len", "512"])
    try:
        port_b = free_port()
        b = c.launch("api-b", api_command(slow_model_dir, c.api_addr, port_b))
        url_b = f"http://127.0.0.1:{port_b}"
        assert eventually(lambda: _health(url_b) == 200, timeout=30), c.log("api-b")
        clients = {
            u: openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0, timeout=30) for u in (c.base_url, url_b)
        }
        ids = tiny_tokenizer.encode("shared scheduler", add_special_tokens=False)
        want = tiny_tokenizer.decode(reference_continuation(ids, 6, ascii_word_tokens(tiny_tokenizer)))
        for u, client in clients.items():
            assert (
                client.completions.create(model="tiny", prompt="shared scheduler", max_tokens=6).choices[0].text == want
            )

        total = metric(c.base_url, "ferry_kv_pages_total")
        started = threading.Event()

        def long_stream_on_b():
            try:
                for _ in clients[url_b].completions.create(
                    model="tiny", prompt="never finished", max_tokens=450, stream=True
                ):
                    started.set()
            except openai.APIError:
                pass

        t = threading.Thread(target=long_stream_on_b, daemon=True)
        t.start()
        assert started.wait(10)
        assert eventually(lambda: metric(c.base_url, "ferry_running_requests") == 1)
        scheduler = f"http://127.0.0.1:{c.scheduler_health_port}"
        steps_before = metric(scheduler, "ferry_scheduler_steps_total")
        b.send_signal(signal.SIGKILL)
        assert eventually(
            lambda: (
                metric(c.base_url, "ferry_running_requests") == 0
                and metric(c.base_url, "ferry_kv_pages_available") == total
            ),
            timeout=30,
        )
        # bounded by work, not seconds: the scheduler dropped the dead replica's request before it generated
        # its 450 tokens (a step each), so its pages came back by the drop, not by the request's end
        assert metric(scheduler, "ferry_scheduler_steps_total") - steps_before < 400
        assert http_get(c.base_url + "/health")[0] == 200
    finally:
        c.stop()


def _health(url: str) -> int:
    try:
        return http_get(url + "/health", timeout=1)[0]
    except OSError:
        return 0
