"""The GPU release check's own machinery, run on CPU with a tiny config: `ferry serve` exactly as the
check starts it, the openai client's steps, SIGTERM and the JSON it commits. (On the GPU the same
script runs the CUDA tests first and serves the Qwen3-30B-A3B config.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_release_check_serves_streams_and_stops_cleanly(tiny_models, tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "tools/gpu_check.py",
        "--out",
        str(out),
        "--skip-tests",
        "--tokens",
        "12",
        "--config",
        str(tiny_models["qwen3_moe"] / "config.json"),
        "--serve-args",
        "--load-format dummy --device cpu --gpu-memory 128MiB --max-model-len 256",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert result["commit"] == head
    assert result["serve_ok"] is True and result["cuda_tests_failed"] == 0
    steps = result["serve"]["steps"]
    assert set(steps) == {
        "streamed_chat",
        "streamed_completion",
        "eight_concurrent_streams",
        "health",
        "worker_metrics",
        "sigterm",
    }
    assert steps["streamed_completion"]["completion_tokens"] == 12
    assert len(steps["eight_concurrent_streams"]["per_stream_tok_s"]) == 8
    assert steps["sigterm"] == {"ok": True, "exit_status": 0, "children": 3, "children_left": []}
    assert result["single_stream_tok_s"] > 0
    assert (out / "gpu_check.log").read_text().strip().endswith(f"{result['seconds']} s")


def test_the_host_kernel_is_built_again_only_when_its_library_is_older_than_a_source(tmp_path):
    """The check keeps an in-place library newer than every source and header pyproject.toml lists for it (an
    editable install built it), and builds one that is missing or older than any of them."""
    import os
    import sysconfig
    import tomllib

    sys.path.insert(0, str(ROOT))
    from tools.gpu_check import host_kernel_up_to_date

    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    (ext,) = setuptools["ext-modules"]
    inputs = [tmp_path / f for f in [*ext["sources"], *ext["depends"]]]
    for f in inputs:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("")
        os.utime(f, (1000, 1000))
    package, module = ext["name"].rsplit(".", 1)
    library = tmp_path / setuptools["package-dir"][package] / (module + sysconfig.get_config_var("EXT_SUFFIX"))
    assert not host_kernel_up_to_date(tmp_path)  # none built
    library.write_text("")
    os.utime(library, (2000, 2000))
    assert host_kernel_up_to_date(tmp_path)
    for f in (inputs[0], inputs[-1]):  # a source, then a header, changed since the build
        os.utime(f, (3000, 3000))
        assert not host_kernel_up_to_date(tmp_path), f
        os.utime(f, (1000, 1000))
    assert host_kernel_up_to_date(tmp_path)


def test_junit_counts_read_failures_and_errors(tmp_path):
    sys.path.insert(0, str(ROOT))
    from tools.gpu_check import junit_counts

    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="1" skipped="1">'
        '<testcase classname="a" name="ok" time="0.5"/>'
        '<testcase classname="a" name="bad" time="12.25"><failure/></testcase>'
        '<testcase classname="b" name="boom"><error/></testcase></testsuite></testsuites>'
    )
    assert junit_counts(xml) == {
        "passed": 2,
        "failed": 2,
        "skipped": 1,
        "failed_tests": ["a::bad", "b::boom"],
        "slowest_tests": [["a::bad", 12.2], ["a::ok", 0.5], ["b::boom", 0.0]],
    }


def test_the_cuda_tests_run_in_two_processes_and_every_verdict_is_counted(tmp_path, monkeypatch):
    """`--workers 2` (the check's default): pytest-xdist a file to a process; the JUnit XML still holds every
    test, its failures and its skips, and each file ran whole in one process."""
    sys.path.insert(0, str(ROOT))
    from tools.gpu_check import Log, run_cuda_tests

    tests = tmp_path / "cuda_tests"
    tests.mkdir()
    for name in ("a", "b"):  # each file records the process its tests ran in
        (tests / f"test_{name}.py").write_text(
            "import os\nimport pytest\n\n"
            f"def test_{name}_one():\n    open(os.environ['PIDS'], 'a').write('{name} ' + str(os.getpid()) + '\\n')\n\n"
            f"def test_{name}_two():\n    open(os.environ['PIDS'], 'a').write('{name} ' + str(os.getpid()) + '\\n')\n"
            f"    assert {name!r} != 'b'\n\n"
            "@pytest.mark.skip(reason='none')\n"
            f"def test_{name}_skipped():\n    pass\n"
        )
    pids = tmp_path / "pids"
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("PIDS", str(pids))  # the pytest processes inherit it
    counts = run_cuda_tests(out, Log(out / "gpu_check.log"), str(tests), timeout=120, workers=2)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (3, 1, 2), counts
    assert len(counts["failed_tests"]) == 1 and counts["failed_tests"][0].endswith("test_b_two"), counts
    ran = [line.split() for line in pids.read_text().splitlines()]
    assert len(ran) == 4 and all(len({pid for f, pid in ran if f == name}) == 1 for name in "ab")
    assert "-n 2 --dist loadfile" in (out / "gpu_check.log").read_text()
