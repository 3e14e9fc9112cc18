"""bench/offload_decode.py runs on CPU with a tiny config, checks itself, and reports consistent numbers."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TINY = {
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_experts": 12,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 16,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("offload_decode_bench", ROOT / "bench" / "offload_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(bench, tmp_path, *flags):
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "result.json"
    args = [
        "--model",
        str(model),
        "--gpu-memory",
        "64MiB",
        "--tokens",
        "8",
        "--warmup",
        "2",
        "--device",
        "cpu",
        "--hbm-bytes",
        str(1 << 20),
        "--quiet",
        "--out",
        str(out),
        *flags,
    ]
    assert bench.main(args) == 0
    return json.loads(out.read_text())


def test_a_small_cache_misses_and_the_numbers_add_up(bench, tmp_path, capsys):
    r = _run(bench, tmp_path, "--moe-cache-size", "14", "--batch", "2", "--zipf", "0.5,1.5", "--policy", "lru,lfu")
    assert [(d["policy"], d["batch"], d["zipf"]) for d in r["runs"]] == [
        ("lru", 2, 0.5),
        ("lru", 2, 1.5),
        ("lfu", 2, 0.5),
        ("lfu", 2, 1.5),
    ]
    d = r["runs"][0]
    assert d["check"]["passed"] and d["check"]["exact"]
    assert r["plan"]["slots"] == 14 and r["plan"]["total_experts"] == 36
    assert 0 < d["hit_rate"] < 1 and d["steps"] == 8
    expert = r["config"]["expert_bytes"]
    assert d["bytes_copied_per_token"] == pytest.approx(d["misses_per_step"] * expert / 2)
    assert d["median_bound_ms_per_step"] > 0 and d["median_ms_per_step"] > 0
    assert r["bandwidth"]["h2d_per_expert_GBps"] > 0 and r["bandwidth"]["hbm_copy_GBps"] > 0
    assert d["expert_cache"]["steps"] == 2 + 8 + 1  # warm-up and timed steps, then the self-check's step
    assert r["runs"][1]["hit_rate"] > d["hit_rate"]  # more skewed routing, more hits
    assert all(run["check"]["passed"] for run in r["runs"])
    assert "expert slots" in capsys.readouterr().out


def test_a_cache_for_every_expert_never_copies(bench, tmp_path):
    r = _run(bench, tmp_path, "--policy", "lru")  # 64 MiB: the planner gives every expert a slot
    assert r["plan"]["slots"] == r["plan"]["total_experts"]
    (d,) = r["runs"]
    assert d["hit_rate"] == 1.0 and d["bytes_copied_per_token"] == 0 and d["expert_cache"]["misses"] == 0


def test_policy_simulation_reports_hit_rates_and_bounds(tmp_path):
    spec = importlib.util.spec_from_file_location("offload_policy_sim", ROOT / "bench" / "offload_policy_sim.py")
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "sim.json"
    assert (
        sim.main(
            [
                "--model",
                str(model),
                "--gpu-memory",
                "64MiB",
                "--moe-cache-size",
                "14",
                "--batch",
                "1,4",
                "--steps",
                "40",
                "--warmup",
                "10",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    assert r["slots"] == 14 and len(r["runs"]) == 4  # lru and lfu x two batches
    for run in r["runs"]:
        assert 0 <= run["hit_rate"] <= 1 and run["routed_per_step"] >= 3 * 3  # >= k per layer
        copied = run["misses_per_step"] * r["expert_bytes"] / run["batch"] / 2**20
        assert run["copied_MiB_per_token"] == pytest.approx(copied)
        assert run["bound_ms_per_token"] > 0
