"""`ferry plan` as a user runs it: a real subprocess, its stdout, stderr and exit status."""

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from ferry.plan.costs import resident_weight_bytes_from_checkpoint, resident_weight_bytes_from_shapes
from ferry.plan.model_config import load_model_config
from tests.helpers import QWEN3_6_35B, QWEN3_30B

FIELDS = {
    "budget_bytes", "weights_bytes", "workspace_bytes", "total_bytes", "headroom_bytes",
}  # fmt: skip


def ferry(*args):
    return subprocess.run([sys.executable, "-m", "ferry.services.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("model", [QWEN3_30B, QWEN3_6_35B])
def test_json_is_one_object_with_the_documented_fields(model):
    out = ferry("plan", "--model", str(model), "--gpu-memory", "24GiB", "--max-model-len", "32768", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)  # exactly one JSON document, nothing else on stdout
    assert FIELDS <= plan.keys()
    assert {"page_size", "pages", "sentinel_pages", "tokens", "bytes_per_token", "bytes"} <= plan["kv"].keys()
    assert {"slots", "padding_slots", "bytes_per_slot", "bytes"} <= plan["linear_state"].keys()
    assert {"slots", "total", "bytes_per_slot", "bytes"} <= plan["experts"].keys()
    parts = plan["weights_bytes"] + plan["workspace_bytes"] + sum(plan[k]["bytes"] for k in ("kv", "linear_state", "experts"))
    assert plan["total_bytes"] == parts
    assert plan["headroom_bytes"] == plan["budget_bytes"] - plan["total_bytes"] >= 0
    assert plan["budget_bytes"] == int(24 * 2**30 * 0.9)


def test_readable_table():
    out = ferry("plan", "--model", str(QWEN3_30B), "--gpu-memory", "24GiB", "--num-tokens", "131072")
    assert out.returncode == 0, out.stderr
    assert "8192 pages x 16 = 131072 tokens + 1 sentinel" in out.stdout
    assert "headroom" in out.stdout


def test_plan_that_cannot_fit_exits_2_with_the_explanation_on_stderr():
    out = ferry("plan", "--model", str(QWEN3_30B), "--gpu-memory", "24GiB", "--num-tokens", "1000000", "--json")
    assert out.returncode == 2 and out.stdout == ""
    assert "does not fit" in out.stderr and "--num-tokens: the largest value that fits is" in out.stderr


@pytest.mark.parametrize("pair", [("--num-tokens", "16", "--num-pages", "1"),
                                  ("--moe-cache-size", "200", "--moe-cache-rate", "0.5")])  # fmt: skip
def test_mutually_exclusive_flags_are_rejected_by_the_parser(pair):
    out = ferry("plan", "--model", str(QWEN3_30B), "--gpu-memory", "24GiB", *pair)
    assert out.returncode == 2 and "not allowed with argument" in out.stderr


def test_bad_byte_size_names_the_flag():
    out = ferry("plan", "--model", str(QWEN3_30B), "--gpu-memory", "lots")
    assert out.returncode == 2 and "--gpu-memory" in out.stderr


def test_weights_from_safetensors_headers_are_exact(tmp_path):
    (tmp_path / "config.json").write_text((QWEN3_30B / "config.json").read_text())
    tensors = {
        "model.embed_tokens.weight": np.zeros((10, 4), dtype=np.float32),  # 160 B -> counted at bf16: 80 -> 512
        "model.layers.0.mlp.experts.3.down_proj.weight": np.zeros((1000, 1000), dtype=np.float32),  # routed: host
        "model.visual.patch.weight": np.zeros((1000,), dtype=np.float32),  # vision tower: not served
        "lm_head.weight": np.zeros((600,), dtype=np.float32),  # 1200 B at bf16 -> 1536
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert resident_weight_bytes_from_checkpoint(tmp_path, "bfloat16") == 512 + 1536
    out = ferry("plan", "--model", str(tmp_path), "--gpu-memory", "24GiB", "--json")
    assert json.loads(out.stdout)["weights_bytes"] == 2048


def test_weights_from_shapes_count_everything_but_routed_experts():
    spec = load_model_config(QWEN3_30B)
    # embed + lm_head, and per layer q (4096x2048), k, v (512x2048), o (2048x4096), router (128x2048)
    per_layer = (4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 128 * 2048) * 2 + (2 * 2048 * 2 + 2 * 128 * 2)
    expected_min = 2 * 151936 * 2048 * 2 + 48 * per_layer
    got = resident_weight_bytes_from_shapes(spec, "bfloat16")
    assert expected_min <= got <= expected_min + (48 * 7 + 3) * 512  # per-tensor 512-byte allocator granules
