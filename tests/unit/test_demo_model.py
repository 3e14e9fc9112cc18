"""`ferry serve` without --model: the demo model is generated once into the cache, then reused."""

from __future__ import annotations

import subprocess

import pytest

from ferry.services import demo_model
from ferry.shared.errors import ModelLoadError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path))
    return tmp_path


def fake_make_tiny_model(calls, returncode=0):
    def run(cmd, **kwargs):
        calls.append(cmd)
        assert cmd[3:4] == ["make-tiny-model"] and cmd[5:] == ["--arch", "qwen3_moe"]
        if returncode == 0:
            (demo_model.Path(cmd[4]) / "config.json").write_text("{}")
        return subprocess.CompletedProcess(cmd, returncode, "", "" if returncode == 0 else "boom: no such arch")

    return run


def test_generated_once_then_reused(cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(demo_model.subprocess, "run", fake_make_tiny_model(calls))
    first = demo_model.ensure_demo_model()
    second = demo_model.ensure_demo_model()
    assert first == second == cache / "tiny-qwen3-moe" and (first / "config.json").is_file()
    assert len(calls) == 1
    assert [p.name for p in cache.iterdir()] == ["tiny-qwen3-moe"]  # no staging directory left behind


def test_a_failed_generation_says_why_and_leaves_nothing_half_made(cache, monkeypatch):
    monkeypatch.setattr(demo_model.subprocess, "run", fake_make_tiny_model([], returncode=2))
    with pytest.raises(ModelLoadError, match="make-tiny-model.*boom: no such arch"):
        demo_model.ensure_demo_model()
    assert list(cache.iterdir()) == []
