"""gpt-oss's sliding layers kept in rings (plan/kv_groups.py) through the real api, scheduler and worker on CPU: with
4 running requests and 24-token chunks each ring is 2 pages of 16 (a window of 8), far fewer than the context's pages,
so the plan takes them, the scheduler gives each running request a slot for its ring and reuses no prefix. Prompts
longer than the ring, sent together and one of them twice, get transformers' prompt logprobs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.integration.harness import REAL_WORKER_ENV, serve_model
from tests.integration.test_quantized_serve import _hf_logprobs
from tests.unit.tiny_models import redrawn_tiny_checkpoint

TOLERANCE = 1e-3  # float32 throughout; the paged sums run in another order than transformers'
PROMPTS = [[(i * k + 11) % 200 for i in range(n)] for k, n in ((37, 90), (53, 70), (29, 110))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return redrawn_tiny_checkpoint(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss")


def test_rings_served_to_requests_side_by_side_equal_transformers(checkpoint, tmp_path):
    flags = ("--dtype", "float32", "--max-running-requests", "4", "--max-prefill-tokens", "24")
    flags += ("--chat-format", "template")  # the tiny tokenizer has no harmony tokens; completions only here
    with serve_model(checkpoint, tmp_path, REAL_WORKER_ENV, *flags) as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=120)

        def prompt_logprobs(ids):
            r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
            return r.choices[0].logprobs.token_logprobs

        with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
            got = list(pool.map(prompt_logprobs, PROMPTS + PROMPTS[:1]))
        ready = [e for e in served.events() if e.get("event") == "worker_ready"]
        assert ready and ready[-1]["prefix_cache"] is False  # rings: no prefix reuse
    for ids, lps in zip(PROMPTS + PROMPTS[:1], got):
        want = _hf_logprobs(checkpoint, ids)
        assert len(lps) == len(ids) and lps[0] is None
        worst = max(abs(lps[p] - float(want[p - 1, ids[p]])) for p in range(1, len(ids)))
        assert worst < TOLERANCE, f"prompt logprobs off by {worst}"
