"""bench's one entry point (`python3 -m bench WORKLOAD [ARGS...]`): it lists every maintained benchmark, each
names a script of bench/ that is there, every script of bench/ is a workload or a shared part of them (so a new
one gets listed), ARGS reach the script, and an unknown workload is refused naming the choices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_every_script_is_a_workload_or_a_shared_part_and_every_workload_a_script():
    from bench.__main__ import HELPERS, WORKLOADS

    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    named = {module for module, _ in WORKLOADS.values()}
    assert named <= scripts, named - scripts
    assert scripts - named == set(HELPERS), scripts - named - set(HELPERS)


def test_help_lists_every_workload():
    from bench.__main__ import WORKLOADS

    done = run("--help")
    assert done.returncode == 0, done.stderr
    for name, (_, what) in WORKLOADS.items():
        assert f"  {name}  " in done.stdout and what in done.stdout


def test_a_workload_gets_its_arguments_and_its_exit_status():
    done = run("json-depth", "--help")
    assert done.returncode == 0, done.stderr
    assert "--repeats" in done.stdout and "json_depth.py" in done.stdout
    bad = run("json-depth", "--no-such-flag")
    assert bad.returncode == 2 and "--no-such-flag" in bad.stderr


def test_an_unknown_workload_is_refused_with_the_choices():
    done = run("decode-suite")
    assert done.returncode == 2
    assert "no workload 'decode-suite'" in done.stderr and "suite, serve, peer" in done.stderr
