"""Long jobs say how far they are: the checkpoint reader in JSON logs (`loading_progress` events, where a
terminal gets a bar) and `ferry make-bench-model`'s random weights (a bar on a terminal, lines elsewhere)."""

from __future__ import annotations

import io

import numpy as np
import structlog
from safetensors.numpy import save_file
from structlog.testing import capture_logs

from ferry.services import bench_model
from ferry.services.worker import checkpoint

SHAPES = {f"model.layers.0.mlp.experts.{e}.down_proj.weight": (8, 4) for e in range(5)}


def _checkpoint(tmp_path):
    save_file(
        {name: np.ones(shape, dtype=np.float32) for name, shape in SHAPES.items()}, str(tmp_path / "model.safetensors")
    )
    return tmp_path


def _read(model_dir, progress: bool, monkeypatch, every: float):
    monkeypatch.setattr(checkpoint, "PROGRESS_EVERY_S", every)
    with capture_logs() as logs:
        monkeypatch.setattr(checkpoint, "log", structlog.get_logger("worker"))  # bound inside the capture
        names = [
            name
            for name, _ in checkpoint.iter_checkpoint_tensors(model_dir, lambda n: True, "loading experts", progress)
        ]
    assert sorted(names) == sorted(SHAPES)
    return [e for e in logs if e["event"] == "loading_progress"]


def test_a_load_without_a_terminal_logs_its_progress(tmp_path, monkeypatch):
    events = _read(_checkpoint(tmp_path), progress=False, monkeypatch=monkeypatch, every=0)
    assert [e["tensors"] for e in events] == [1, 2, 3, 4, 5]  # every interval (0 here: every tensor)
    assert all(e["total"] == 5 and e["what"] == "loading experts" and e["seconds"] >= 0 for e in events)
    assert [e["bytes"] for e in events] == [k * 8 * 4 * 4 for k in range(1, 6)]


def test_a_short_load_stays_quiet_and_a_terminal_gets_the_bar_instead(tmp_path, monkeypatch):
    model_dir = _checkpoint(tmp_path)
    assert _read(model_dir, progress=False, monkeypatch=monkeypatch, every=checkpoint.PROGRESS_EVERY_S) == []
    assert _read(model_dir, progress=True, monkeypatch=monkeypatch, every=0) == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bench_model_weights_print_progress_lines_off_a_terminal_and_a_bar_on_one(
    tiny_models, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(bench_model, "PROGRESS_EVERY_S", 0)
    out = bench_model.write_bench_model(tmp_path / "m", tiny_models["qwen3_moe"] / "config.json")
    size = bench_model.write_random_weights(out, dtype="float32")
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(ln.startswith("make-bench-model: ") and " tensors, " in ln for ln in lines)
    total = int(lines[-1].split()[1].split("/")[1])
    assert lines[-1].startswith(f"make-bench-model: {total}/{total} tensors, {size / 2**30:.2f} GiB")
    terminal = _Terminal()
    progress = bench_model._Progress(3, stream=terminal)
    for _ in range(3):
        progress.update(10)
    progress.close()
    assert "random weights" in terminal.getvalue() and "make-bench-model:" not in terminal.getvalue()
