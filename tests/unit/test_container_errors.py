"""What a user of the image meets when a directory is not the container user's: a clear error that
says what to do, never a traceback (the demo's model cache, `ferry keys` into a host directory)."""

from __future__ import annotations

import pytest

from ferry.services import demo_model
from ferry.services.cli import main
from ferry.shared import wire_keys
from ferry.shared.errors import ModelLoadError


def _denied(*args, **kwargs):
    raise PermissionError(13, "Permission denied", "/home/ferry/.cache/ferry")


def test_a_demo_cache_the_user_cannot_write_is_a_clear_error(tmp_path, monkeypatch):
    """compose's demo-cache volume, made root-owned by an image that lacked its mount point."""
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_model.tempfile, "mkdtemp", _denied)
    with pytest.raises(ModelLoadError) as caught:
        demo_model.ensure_demo_model()
    message = str(caught.value)
    assert str(tmp_path / "cache") in message and "Permission denied" in message
    assert "FERRY_CACHE_DIR" in message and "docker volume rm ferry_demo-cache" in message


def test_keys_into_a_directory_the_user_cannot_write_name_docker_run_u(monkeypatch, capsys):
    """`docker run --rm -v "$PWD/keys:/keys" ferry:0.1.0 keys /keys/new`: uid 10001 in a host user's directory."""
    monkeypatch.setattr(wire_keys, "generate", _denied)
    assert main(["keys", "/keys/new"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ferry keys: error: cannot write the keys to /keys/new: Permission denied")
    assert '-u "$(id -u):$(id -g)"' in err and "Traceback" not in err
