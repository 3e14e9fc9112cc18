from __future__ import annotations

import pytest

from tests.integration.harness import make_model_dir, start_cluster

# default pools of the shared cluster: 256 pages x 16 tokens, model length 512


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tiny_tokenizer_dir, tiny_tokenizer):
    return make_model_dir(tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "tiny", tiny_tokenizer)


@pytest.fixture(scope="session")
def slow_model_dir(tmp_path_factory, tiny_tokenizer_dir, tiny_tokenizer):
    """Steps take 20 ms, so a stream lasts long enough to disconnect from or to kill the worker under."""
    return make_model_dir(tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "slow", tiny_tokenizer, 0.02)


@pytest.fixture(scope="session")
def cluster(model_dir, tmp_path_factory):
    c = start_cluster(model_dir, tmp_path_factory.mktemp("cluster"), worker_flags=["--max-model-len", "512"])
    yield c
    c.stop()


class GreedyReference:
    """The single-request greedy output of a real tiny checkpoint, computed in this process by the code
    `ferry generate` runs (ferry.services.generate_command.generate over boot_worker's executor), with every
    expert resident: what the served cluster must reproduce however it batches, offloads or preempts."""

    def __init__(self, model_dir):
        import torch
        from transformers import AutoTokenizer

        from ferry.plan.planner import PlanRequest
        from ferry.services.worker.boot import boot_worker
        from ferry.services.worker.flags import WorkerBootConfig
        from ferry.shared.eos import eos_token_ids

        cfg = WorkerBootConfig(
            model=str(model_dir),
            device="cpu",
            plan=PlanRequest(num_pages=64, max_model_len=512, max_running_requests=4),
        )
        self.torch = torch
        self.executor, _ = boot_worker(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos_ids = eos_token_ids(model_dir, self.tokenizer)  # what `ferry generate` stops on

    def chat_ids(self, messages) -> list[int]:
        """The prompt the api builds for a chat request (services/api/tokenizer.py)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def text_ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def ids(self, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True) -> tuple[list[int], str]:
        """(greedy token ids, finish reason)."""
        from ferry.services.generate_command import generate
        from ferry.shared.sampling import SamplingParams

        threads = self.torch.get_num_threads()
        self.torch.set_num_threads(1)  # tiny ops: one thread is several times faster on a busy 2-core runner
        try:
            params = SamplingParams(temperature=0.0, ignore_eos=ignore_eos)
            out, _, reason = generate(self.executor, list(prompt_ids), params, max_tokens, self.eos_ids)
        finally:
            self.torch.set_num_threads(threads)
        return out, reason

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)  # as `ferry generate` prints it


@pytest.fixture(scope="session")
def greedy_reference(tiny_models):
    """{arch: GreedyReference}, each booted on first use."""

    class Lazy(dict):
        def __missing__(self, arch):
            self[arch] = GreedyReference(tiny_models[arch])
            return self[arch]

    return Lazy()


@pytest.fixture
def short_tmp_path():
    """A fresh directory right under /tmp, for tests that look for serve's socket directory in TMPDIR:
    pytest's tmp_path can be too deep for a Unix socket's path (under pytest-xdist it is one level deeper),
    and then serve rightly puts its sockets in /tmp instead (shared.defaults.rundir_base)."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="ferry-test-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
