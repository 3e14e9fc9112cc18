"""What a person at a terminal sees: readable log lines and progress bars for loading and pinning
(`ferry generate` on a pseudo-terminal), while a pipe or a file gets one JSON object per line and
no bars; --log-format overrides the choice."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import select
import struct
import subprocess
import sys
import termios

import structlog

from ferry.shared.logging import configure_logging
from tests.integration.harness import REPO, child_env


def run_on_a_terminal(argv: list[str], timeout: float = 120) -> str:
    """argv run with stdin/stdout/stderr on a pseudo-terminal of 120 columns; everything it wrote."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm draws nothing at 0 columns
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=child_env(), start_new_session=True
    )
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            if not ready:
                raise TimeoutError(out.decode(errors="replace")[-2000:])
            try:
                data = os.read(master, 65536)
            except OSError as exc:  # EIO: the terminal's other side has closed
                if exc.errno != errno.EIO:
                    raise
                break
            if not data:
                break
            out += data
    finally:
        os.close(master)
        proc.wait(timeout=30)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


def test_a_terminal_gets_readable_lines_and_progress_bars(tiny_models):
    out = run_on_a_terminal(
        [
            sys.executable,
            "-m",
            "ferry.services.cli",
            "generate",
            str(tiny_models["qwen3_moe"]),
            "--prompt",
            "The ferry",
            "--max-tokens",
            "2",
            "--device",
            "cpu",
            "--moe-cache-size",
            "12",
        ]
    )
    assert "loading weights" in out and "loading experts" in out  # the checkpoint's two passes
    assert "allocating expert banks" in out  # the host banks (pinned where there is CUDA)
    lines = [line for line in out.replace("\r", "\n").splitlines() if "experts_loaded" in line]
    assert lines and not any(line.lstrip().startswith("{") for line in lines)
    assert "generate" in lines[0] and "preloaded_slots" in lines[0]  # [process], event, key=value


def test_json_unless_a_terminal_and_the_flag_overrides(capsys):
    try:
        configure_logging("probe", fmt="auto")  # pytest's stderr is no terminal
        structlog.get_logger("t1").info("probe_event", answer=42)
        line = capsys.readouterr().err.strip()
        assert json.loads(line) == {**json.loads(line), "event": "probe_event", "answer": 42, "process": "probe"}
        configure_logging("probe", fmt="console")
        structlog.get_logger("t2").info("probe_event", answer=42)
        text = capsys.readouterr().err
        assert "probe_event" in text and "answer=42" in text and "[probe]" in text and "\x1b[" not in text
        assert not text.lstrip().startswith("{")
    finally:
        configure_logging("pytest", fmt="json")


def test_a_dummy_load_on_a_terminal_shows_progress_bars(tiny_models):
    """--load-format dummy draws every tensor (seconds to minutes for a real config): bars for the resident
    weights and the routed experts, as a checkpoint load has."""
    out = run_on_a_terminal(
        [
            sys.executable,
            "-m",
            "ferry.services.cli",
            "generate",
            str(tiny_models["qwen3_moe"]),
            "--load-format",
            "dummy",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "1",
            "--device",
            "cpu",
        ]
    )
    assert "random weights" in out and "random experts" in out, out[-2000:]


def test_make_bench_model_on_a_terminal_shows_a_progress_bar(tiny_models, tmp_path):
    out = run_on_a_terminal(
        [
            sys.executable,
            "-m",
            "ferry.services.cli",
            "make-bench-model",
            str(tmp_path / "m"),
            "--config",
            str(tiny_models["qwen3_moe"] / "config.json"),
            "--weights",
            "random",
        ]
    )
    assert "random weights:" in out and "tensor/s" in out, out[-2000:]


def test_bars_only_where_stderr_is_a_terminal(monkeypatch):
    import io

    from ferry.services.worker import boot

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert boot._progress_bars()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not boot._progress_bars()
