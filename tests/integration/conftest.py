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
