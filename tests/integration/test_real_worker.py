"""The real worker (services.worker.boot) behind the real api and scheduler, on CPU with the tiny
model: greedy output through the openai client equals `ferry generate`. The served worker offloads
experts (12 slots for 24 experts) while `ferry generate` keeps all of them resident, so equal
outputs also say offload changes nothing; the expert-cache counters reach the worker's and the
api's /metrics.

Skipped until the worker's data plane is merged; interfaces assumed here:
  ferry make-tiny-model DIR --arch qwen3_moe
  ferry generate --model DIR --prompt TEXT --max-tokens N   (greedy; prints the completion text on stdout)
  services.worker.boot.boot_worker(args) -> (executor, plan)
"""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from tests.integration.harness import REPO, child_env, eventually, metric, start_cluster

pytest.importorskip("services.worker.boot", reason="the real worker is not merged into this branch yet")

PROMPT = "The ferry carries"


def ferry(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    model = tmp_path_factory.mktemp("real") / "tiny-qwen3-moe"
    ferry("make-tiny-model", str(model), "--arch", "qwen3_moe")
    c = start_cluster(model, tmp_path_factory.mktemp("real-run"), worker_flags=["--device", "cpu", "--max-model-len", "256",
                                                                                  "--moe-cache-size", "12"],
                      boot="services.worker.boot:boot_worker")  # fmt: skip
    yield c
    c.stop()


def test_greedy_completion_equals_ferry_generate(real_cluster):
    expected = ferry("generate", "--model", str(real_cluster.model_dir), "--prompt", PROMPT, "--max-tokens", "12")
    client = openai.OpenAI(base_url=real_cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected.rstrip("\n")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True))  # fmt: skip
    assert streamed == r.choices[0].text


def test_chat_streams_and_counts_tokens(real_cluster):
    client = openai.OpenAI(base_url=real_cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].usage.completion_tokens <= 8
    assert chunks[-1].usage.completion_tokens == 8 or any(
        c.choices and c.choices[0].finish_reason == "stop" for c in chunks)


def test_expert_cache_counters_reach_worker_and_api_metrics(real_cluster):
    client = openai.OpenAI(base_url=real_cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    worker = f"http://127.0.0.1:{real_cluster.worker_health_port}"
    hits, misses = metric(worker, "ferry_worker_expert_hits_total"), metric(worker, "ferry_worker_expert_misses_total")
    assert hits > 0 and misses > 0, "12 slots for 24 experts: some lookups hit, some miss"
    assert metric(worker, "ferry_worker_expert_copied_bytes_total") == misses * 3 * 32 * 64 * 4  # fp32 gate, up, down
    assert metric(worker, "ferry_worker_expert_slots") == 12
    # the worker's heartbeat carries (hits, misses) through the scheduler to the api's gauge
    eventually(lambda: metric(real_cluster.base_url, "ferry_expert_hit_rate") > 0, timeout=10)
    assert 0 < metric(real_cluster.base_url, "ferry_expert_hit_rate") < 1


def test_worker_log_is_json_lines(real_cluster):
    import json

    events = [json.loads(line) for line in real_cluster.log("worker").splitlines() if line.strip()]
    by_name = {e["event"]: e for e in events}
    assert by_name["plan"]["expert_slots"] == 12 and by_name["plan"]["expert_store"] == "lfu"
    assert by_name["expert_host_banks"]["pinned"] is False  # no CUDA here
    assert by_name["experts_loaded"]["preloaded_slots"] == 12
