"""A model that is not there fails `ferry serve|plan|generate|worker` at once, in the command itself, with
an error naming --model: before serve starts its three processes (which printed a huggingface_hub
"Repo id must be..." before the worker's own error), before a worker binds its sockets, before a boot."""

from __future__ import annotations

import contextlib
import io

import pytest

from ferry.services.cli import main

MISSING = {
    "a path": "/nonexistent/model",
    "a relative path": "./no-such-model",
    "a home path": "~/no-such-model",
    "a hub id not in the cache": "no-such-org/no-such-model",
}
EXTRA = {
    "serve": [],
    "plan": ["--gpu-memory", "24GiB"],
    "generate": ["--prompt", "hi"],
    "worker": ["--steps-addr", "ipc:///tmp/x-steps", "--results-addr", "ipc:///tmp/x-results"],
}


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch, tmp_path):
    """Fail the test loudly instead of starting processes, a worker or a boot, were the check missing."""
    import ferry.services.serve_command as serve
    import ferry.services.worker.boot as boot
    import ferry.services.worker.service as service

    def started(*_a, **_k):
        raise AssertionError("started before the model was checked")

    monkeypatch.setattr(serve.subprocess, "Popen", started)
    monkeypatch.setattr(boot, "boot_worker", started)
    monkeypatch.setattr(service, "WorkerService", started)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))


@pytest.mark.parametrize("command", list(EXTRA))
@pytest.mark.parametrize("what", list(MISSING))
def test_a_missing_model_is_an_error_naming_model(command, what):
    model = MISSING[what]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main([command, "--model", model, *EXTRA[command]])
    text = err.getvalue()
    assert status == 2 and f"--model {model}:" in text, text
    assert "Repo id must" not in text and "Traceback" not in text, text
    if what == "a hub id not in the cache":
        assert "not in the Hugging Face cache" in text and "huggingface-cli download" in text, text
    else:
        assert "no such directory" in text, text
