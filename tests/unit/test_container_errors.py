"""What a user of the image meets when a directory is not the container user's: a clear error that
says what to do, never a traceback (the demo's model cache, `ferry keys` into a host directory, a model
the container's uid 10001 cannot read), and files written on the host that the container can read."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

import pytest

from ferry.services import demo_model
from ferry.services.cli import main
from ferry.services.worker import model_source
from ferry.shared import wire_keys
from ferry.shared.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[2]


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
    """`docker run --rm -v "$PWD/keys:/keys" ferry:0.1.0 keys /keys`: uid 10001 in a host user's directory."""
    monkeypatch.setattr(wire_keys, "generate", _denied)
    assert main(["keys", "/keys"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ferry keys: error: cannot write the keys to /keys: Permission denied")
    assert '-u "$(id -u):$(id -g)"' in err and "Traceback" not in err


def test_the_documented_keys_command_writes_into_the_directory_compose_reads(tmp_path, capsys):
    """The README's `... keys /keys/new && mv keys/new/* keys/` left an empty keys/new behind: the
    command writes into the mounted directory itself, which `mkdir -p keys` made (an existing, empty
    directory), and the README and the error above show that same command."""
    from ferry.services.keys_command import DOCKER_KEYS_COMMAND

    host_dir, mounted = re.search(r'-v "\$PWD/(\w+):(/\w+)"', DOCKER_KEYS_COMMAND).groups()
    assert f"mkdir -p {host_dir} " in DOCKER_KEYS_COMMAND and DOCKER_KEYS_COMMAND.endswith(f" keys {mounted}")
    assert DOCKER_KEYS_COMMAND in (REPO / "README.md").read_text()
    keys = tmp_path / host_dir
    keys.mkdir()
    assert main(["keys", str(keys)]) == 0
    assert sorted(p.name for p in keys.iterdir()) == sorted(
        f"{role}{suffix}" for role in wire_keys.ROLES for suffix in (".key", ".key_secret")
    )


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(directory: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}


def test_make_tiny_model_writes_files_another_user_can_read(tmp_path, umask_022):
    """`ferry make-tiny-model ./models` as the host user wrote model.safetensors 0600 (transformers
    writes it through a temporary file), which the container's uid 10001 could not read."""
    out = tmp_path / "models"
    assert main(["make-tiny-model", str(out)]) == 0
    assert modes(out) and set(modes(out).values()) == {0o644}, modes(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_make_bench_model_writes_files_another_user_can_read(tiny_models, tmp_path, umask_022):
    out = tmp_path / "bench"
    assert (
        main(
            [
                "make-bench-model",
                str(out),
                "--config",
                str(tiny_models["qwen3_moe"] / "config.json"),
                "--weights",
                "random",
            ]
        )
        == 0
    )
    assert any(name.endswith(".safetensors") for name in modes(out))
    assert set(modes(out).values()) == {0o644}, modes(out)


def test_written_files_follow_the_umask_and_files_already_there_keep_their_mode(tmp_path):
    """The mode open() gives a new file under the umask: a user whose umask keeps others out (027) keeps
    them out; a file the command did not write is left as it was."""
    from ferry.shared.file_modes import written_with_umask_modes

    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    kept.chmod(0o600)
    old = os.umask(0o027)
    try:
        with written_with_umask_modes(tmp_path):
            fd, written = tempfile.mkstemp(dir=tmp_path)  # 0600, as a temporary file is
            os.close(fd)
    finally:
        os.umask(old)
    assert modes(tmp_path) == {"notes.txt": 0o600, Path(written).name: 0o640}


def test_a_model_file_the_process_cannot_read_is_permission_denied_naming_it(tiny_models, tmp_path, monkeypatch):
    """safetensors reports a shard it may not open as "No such file or directory": the worker of a
    container (uid 10001) said file-not-found for a host user's 0600 model.safetensors."""
    model = tmp_path / "model"
    model.mkdir()
    for f in tiny_models["qwen3_moe"].iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "model.safetensors").chmod(0o600)
    shard = str(model / "model.safetensors")
    real_access = os.access  # the suite may run as root, whom no mode stops: the check is what is tested
    monkeypatch.setattr(model_source.os, "access", lambda p, mode: str(p) != shard and real_access(p, mode))
    with pytest.raises(ModelLoadError) as caught:
        model_source.resolve_model_dir(str(model))
    message = str(caught.value)
    assert "permission denied" in message and f"{shard} (mode 0600, owner uid {os.getuid()})" in message
    assert "chmod -R a+rX" in message and "No such file" not in message


def test_a_model_directory_the_process_cannot_enter_is_permission_denied_not_missing_config(tmp_path, monkeypatch):
    """A 0700 directory of another user: config.json inside looked absent ("has no config.json")."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    real_access = os.access
    monkeypatch.setattr(model_source.os, "access", lambda p, mode: str(p) != str(model) and real_access(p, mode))
    with pytest.raises(ModelLoadError, match=rf"permission denied: {re.escape(str(model))} \(mode"):
        model_source.resolve_model_dir(str(model))
