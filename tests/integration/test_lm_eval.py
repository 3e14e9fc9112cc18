"""lm-eval, unmodified, against `ferry serve` on the real tiny qwen3_moe model (CPU): `local-completions`
runs a multiple-choice task (every choice a loglikelihood request: completions with echo, logprobs 1 and
max_tokens 1) and `local-chat-completions` a generate-until task, five questions each (task files in
tests/data/lm_eval/, local data, no network). Each run must exit 0 and report its metric."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DATA
from tests.integration.harness import REAL_WORKER_ENV, serve_model

TASKS = DATA / "lm_eval"


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    with serve_model(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("serve-lm-eval"), REAL_WORKER_ENV) as s:
        yield s.url


def lm_eval(tmp: Path, *args: str) -> dict:
    """Run the lm-eval command line; its results (the one results file it writes)."""
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf"),
        "OPENAI_API_KEY": "unused",
        "TOKENIZERS_PARALLELISM": "false",
    }
    out = tmp / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "run",
            *args,
            "--include_path",
            str(TASKS),
            "--limit",
            "5",
            "--output_path",
            str(out),
        ],
        cwd=TASKS,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    (path,) = list(out.rglob("results_*.json"))
    return json.loads(path.read_text())["results"]


@pytest.mark.slow
def test_local_completions_runs_a_multiple_choice_task(served, tiny_models, tmp_path):
    results = lm_eval(
        tmp_path,
        "--model",
        "local-completions",
        "--tasks",
        "ferry_mc",
        "--model_args",
        f"model=tiny,base_url={served}/v1/completions,tokenizer={tiny_models['qwen3_moe']},"
        "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1",
    )
    acc = results["ferry_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0


@pytest.mark.slow
def test_local_chat_completions_runs_a_generate_until_task(served, tmp_path):
    results = lm_eval(
        tmp_path,
        "--model",
        "local-chat-completions",
        "--tasks",
        "ferry_gen",
        "--apply_chat_template",
        "--model_args",
        f"model=tiny,base_url={served}/v1/chat/completions,num_concurrent=1,max_retries=1",
    )
    match = results["ferry_gen"]["exact_match,none"]
    assert 0.0 <= match <= 1.0
