"""The real worker with a KV pool too small for the requests it runs: preemption (pages freed, the
request recomputed from its prompt plus what it already produced) must not change any greedy output.

Both architectures: qwen3_moe, where a preempted request's full pages stay in the prefix cache and
its recomputation starts after the longest cached prefix (shared with other requests' pages); and the
hybrid qwen3_5_moe (Gated DeltaNet + gated attention + MoE), where a preempted request also gives up
its linear-state slot and restarts from the deepest linear-state snapshot on its path (its output's last page
boundary, or its prompt's), or from zero when the KV cache evicted those with their pages."""

from __future__ import annotations

import openai
import pytest

from tests.integration.harness import REAL_WORKER_ENV, eventually, metric, start_cluster, stream_concurrently

MESSAGES = [{"role": "user", "content": "Which ferry crosses the river at dawn?"}]

PAGES = 24  # x 4 tokens = 96 tokens of KV; 8 requests x (~12 prompt + 36 output) need ~380


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def small_cluster(arch, tiny_models, tmp_path_factory):
    flags = [
        "--device",
        "cpu",
        "--num-pages",
        str(PAGES),
        "--page-size",
        "4",
        "--max-model-len",
        "64",
        "--max-running-requests",
        "8",
    ]
    c = start_cluster(
        tiny_models[arch],
        tmp_path_factory.mktemp("small-" + arch),
        worker_flags=flags,
        boot="ferry.services.worker.boot:boot_worker",
        worker_env=REAL_WORKER_ENV,
    )
    yield c
    c.stop()


def test_chat_equals_the_single_request_greedy_output(arch, small_cluster, greedy_reference):
    ref = greedy_reference[arch]
    prompt = ref.chat_ids(MESSAGES)
    ids, reason = ref.ids(prompt, 12, ignore_eos=False)
    assert ref.text(ids).strip()
    client = openai.OpenAI(base_url=small_cluster.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref.text(ids) and r.choices[0].finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(ids))


def test_preemption_lets_every_request_finish_with_its_single_request_output(arch, small_cluster, greedy_reference):
    ref = greedy_reference[arch]
    c = small_cluster
    jobs = [(f"request number {i} crosses the river", 36) for i in range(8)]
    results = stream_concurrently(c.base_url, jobs)
    for (prompt, n), (text, usage, reason) in zip(jobs, results):
        assert (usage, reason) == (n, "length"), prompt
        assert text == ref.text(ref.ids(ref.text_ids(prompt), n)[0]), f"preemption changed the output of {prompt!r}"
    sched = f"http://127.0.0.1:{c.scheduler_health_port}"
    assert eventually(lambda: metric(sched, "ferry_scheduler_preemptions_total") > 0, timeout=9)
    assert eventually(lambda: metric(c.base_url, "ferry_preemptions_total") > 0, timeout=9)
    assert eventually(lambda: metric(sched, "ferry_scheduler_kv_pages_available") == PAGES, timeout=9)
