"""bench/profile_shared_prefix_step.py end to end on CPU: the tiny hybrid model offloaded, 8 streams sharing a
prefix, each step profiled and its copies counted (the device figures need CUDA; here the flow and the JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_warm_steps_and_the_baseline_chunk_are_profiled(tiny_models, tmp_path):
    model = tiny_models["qwen3_5_moe"]
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/profile_shared_prefix_step.py",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--moe-cache-size",
            "8",
            "--max-running-requests",
            "8",
            "--max-model-len",
            "1024",
            "--prefix",
            "40",
            "--suffix",
            "8",
            "--repeats",
            "2",
            "--host-profile",
            "2",
            "--out",
            str(out),
            "--events-dir",
            str(tmp_path / "events"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    steps = {p["step"]: p for p in result["profiles"]}
    assert list(steps) == ["warm_step_0", "warm_step_1", "baseline_chunk"]
    assert steps["warm_step_0"]["rows"] == 8 and steps["warm_step_0"]["tokens"] == 8 * 8
    assert steps["baseline_chunk"]["tokens"] == 8 * 48  # the 48-token prompts fit one chunk here
    # the tiny model's 8 slots hold a quarter of its 4 x 8 experts: every step copies some of the rest
    assert all(p["copied_bytes"] > 0 and p["pass_ms_at_link"] > 0 for p in steps.values())
    assert sorted(f.name for f in (tmp_path / "events").iterdir()) == [
        "device_events_baseline_chunk.json.gz",
        "device_events_warm_step_0.json.gz",
        "device_events_warm_step_1.json.gz",
    ]
    # the host's profile: two warm steps' walls, the functions by own time, the project's by cumulative time
    host = result["host_profile"]
    assert host["steps"] == 2 and len(host["wall_ms"]) == 2 and all(w > 0 for w in host["wall_ms"])
    ours = [r["function"] for r in host["ours_by_cumulative_time"]]
    assert any(f.startswith("services/worker/executor.py:") for f in ours), ours[:5]
    assert all(r["own_ms"] >= 0 and r["calls"] > 0 for r in host["by_own_time"])
