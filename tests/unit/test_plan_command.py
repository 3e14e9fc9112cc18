"""`ferry plan` as a user runs it: a real subprocess, its stdout, stderr and exit status."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from ferry.plan.costs import resident_weight_bytes_from_checkpoint, resident_weight_bytes_from_shapes
from ferry.plan.model_config import load_model_config
from ferry.plan.outside_memory import CUDA_CONTEXT_ESTIMATE, LATE_MODULES_MARGIN
from tests.helpers import QWEN3_6_35B, QWEN3_30B, cuda_plan_budget

FIELDS = {
    "budget_bytes",
    "weights_bytes",
    "workspace_bytes",
    "total_bytes",
    "headroom_bytes",
}


# the full-size configs offload at 24GiB: their banks (54 and 60 GiB) are checked against host RAM,
# so plans meant for a bigger machine than this one say how much it has
HOST = ("--host-memory", "128GiB")


def ferry(*args):
    return subprocess.run(
        [sys.executable, "-m", "ferry.services.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("model", [QWEN3_30B, QWEN3_6_35B])
def test_json_is_one_object_with_the_documented_fields(model):
    out = ferry("plan", "--model", str(model), "--gpu-memory", "24GiB", "--max-model-len", "32768", "--json", *HOST)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)  # exactly one JSON document, nothing else on stdout
    assert FIELDS <= plan.keys()
    assert {"page_size", "pages", "sentinel_pages", "tokens", "bytes_per_token", "bytes"} <= plan["kv"].keys()
    assert {"slots", "padding_slots", "bytes_per_slot", "bytes"} <= plan["linear_state"].keys()
    assert {"slots", "total", "bytes_per_slot", "bytes"} <= plan["experts"].keys()
    pools = ("kv", "linear_state", "linear_state_snapshots", "experts")
    parts = plan["weights_bytes"] + plan["workspace_bytes"] + sum(plan[k]["bytes"] for k in pools)
    assert plan["total_bytes"] == parts
    assert plan["headroom_bytes"] == plan["budget_bytes"] - plan["total_bytes"] >= 0
    assert plan["budget_bytes"] == cuda_plan_budget(24 * 2**30)


def test_readable_table():
    out = ferry("plan", "--model", str(QWEN3_30B), "--gpu-memory", "24GiB", "--num-tokens", "131072", *HOST)
    assert out.returncode == 0, out.stderr
    assert "8192 pages x 16 = 131072 tokens + 1 sentinel" in out.stdout
    assert "headroom" in out.stdout


def test_plan_that_cannot_fit_exits_2_with_the_explanation_on_stderr():
    out = ferry("plan", "--model", str(QWEN3_30B), "--gpu-memory", "24GiB", "--num-tokens", "1000000", "--json", *HOST)
    assert out.returncode == 2 and out.stdout == ""
    assert "does not fit" in out.stderr and "--num-tokens: the largest value that fits is" in out.stderr


@pytest.mark.parametrize(
    "pair", [("--num-tokens", "16", "--num-pages", "1"), ("--moe-cache-size", "200", "--moe-cache-rate", "0.5")]
)
def test_mutually_exclusive_flags_are_rejected_by_the_parser(pair):
    out = ferry("plan", "--model", str(QWEN3_30B), "--gpu-memory", "24GiB", *pair, *HOST)
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
    out = ferry("plan", "--model", str(tmp_path), "--gpu-memory", "24GiB", "--json", *HOST)
    assert json.loads(out.stdout)["weights_bytes"] == 2048


def test_weights_from_shapes_count_everything_but_routed_experts():
    spec = load_model_config(QWEN3_30B)
    # embed + lm_head, and per layer q (4096x2048), k, v (512x2048), o (2048x4096), router (128x2048)
    per_layer = (4096 * 2048 + 2 * 512 * 2048 + 2048 * 4096 + 128 * 2048) * 2 + (2 * 2048 * 2 + 2 * 128 * 2)
    expected_min = 2 * 151936 * 2048 * 2 + 48 * per_layer
    got = resident_weight_bytes_from_shapes(spec, "bfloat16")
    assert expected_min <= got <= expected_min + (48 * 7 + 3) * 512  # per-tensor 512-byte allocator granules


@pytest.mark.parametrize(
    "model, layers, experts, values",
    [
        (QWEN3_30B, 48, 128, 3 * 768 * 2048),  # 3 x moe_intermediate_size x hidden
        (QWEN3_6_35B, 40, 256, 3 * 512 * 2048),
    ],
)
@pytest.mark.parametrize("fmt", ["plain", "packed", None])
def test_json_host_figures_are_the_pinned_expert_banks(model, layers, experts, values, fmt):
    flags = ["--expert-bank-format", fmt] if fmt else []
    out = ferry("plan", str(model), "--gpu-memory", "24GiB", "--host-memory", "100GiB", "--json", *flags)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["experts"]["slots"] < plan["experts"]["total"] == layers * experts  # 24GiB offloads
    assert plan["host"]["expert_bank_format"] == (fmt or "packed")  # bf16 models pack by default
    if fmt == "plain":
        assert plan["host"]["expert_bank_bytes"] == layers * experts * values * 2  # 54 GiB, 60 GiB
    else:  # 1.5 B a value, two int32 bases, 6 B for every 512th value (escapes), int64 offsets per layer
        per_expert = values * 3 // 2 + 8 + values // 512 * 6
        assert plan["host"]["expert_bank_bytes"] == layers * (experts * per_expert + (experts + 1) * 8)
    assert plan["host"]["available_bytes"] == 100 * 2**30 and plan["host"]["available_source"] == "--host-memory"
    # without --host-memory: what this machine has (MemAvailable), read when the plan is made
    here = ferry("plan", str(model), "--gpu-memory", "200GiB", "--moe-cache-rate", "1.0", "--json")
    assert here.returncode == 0, here.stderr
    host = json.loads(here.stdout)["host"]
    assert host["expert_bank_bytes"] == 0 and host["available_source"] == "MemAvailable"  # every expert resident
    assert 0 < host["available_bytes"] <= 2**50


def test_offload_that_does_not_fit_host_ram_is_a_plan_error_with_the_figures():
    out = ferry(
        "plan",
        str(QWEN3_30B),
        "--gpu-memory",
        "24GiB",
        "--host-memory",
        "40GiB",
        "--json",
        "--expert-bank-format",
        "plain",
    )
    assert out.returncode == 2 and out.stdout == ""
    assert "do not fit in host RAM" in out.stderr and "54.00 GiB" in out.stderr
    assert "48 MoE layers x 128 experts, plain" in out.stderr
    assert "--host-memory 40.00 GiB" in out.stderr and "at least 56.00 GiB" in out.stderr
    packed = ferry("plan", str(QWEN3_30B), "--gpu-memory", "24GiB", "--host-memory", "40GiB", "--json")
    assert packed.returncode == 2 and "40.82 GiB" in packed.stderr and "experts, packed" in packed.stderr
    fits = ferry("plan", str(QWEN3_30B), "--gpu-memory", "24GiB", "--host-memory", "43GiB", "--json")
    assert fits.returncode == 0, fits.stderr  # packed banks fit where plain ones would not


def test_packed_banks_are_refused_for_a_model_that_is_not_bf16():
    out = ferry(
        "plan",
        str(QWEN3_30B),
        "--gpu-memory",
        "24GiB",
        "--host-memory",
        "100GiB",
        "--dtype",
        "float16",
        "--expert-bank-format",
        "packed",
    )
    assert out.returncode != 0 and "--expert-bank-format" in out.stderr and "float16" in out.stderr
    auto = ferry(
        "plan", str(QWEN3_30B), "--gpu-memory", "24GiB", "--host-memory", "100GiB", "--dtype", "float16", "--json"
    )
    assert auto.returncode == 0 and json.loads(auto.stdout)["host"]["expert_bank_format"] == "plain"


def test_table_has_a_header_row_labelled_columns_and_host_rows():
    out = ferry("plan", str(QWEN3_6_35B), "--gpu-memory", "24GiB", *HOST)
    assert out.returncode == 0, out.stderr
    header, rule, *rows = out.stdout.splitlines()
    assert header.split()[:3] == ["term", "size", "bytes"] and "how it was sized" in header
    assert set(rule.replace(" ", "")) == {"-"}
    banks = next(r for r in rows if r.startswith("host: expert banks (pinned)"))
    assert "packed to 12 bits a value" in banks and "6291456 B as bf16" in banks
    assert any(r.startswith("host: available") and "128.00 GiB" in r for r in rows)


@pytest.mark.parametrize("value, hint", [("24", "24GiB"), ("0.9", "--gpu-memory-utilization 0.9")])
def test_gpu_memory_without_a_unit_is_refused_with_the_form_to_use(value, hint):
    out = ferry("plan", str(QWEN3_30B), "--gpu-memory", value)
    assert out.returncode == 2 and "no unit" in out.stderr and hint in out.stderr and "24GiB" in out.stderr


def test_vllm_and_sglang_names_of_the_flags_are_aliases():
    ours = ferry(
        "plan",
        str(QWEN3_30B),
        "--gpu-memory",
        "80GiB",
        "--memory-ratio",
        "0.8",
        "--max-running-requests",
        "8",
        "--max-prefill-tokens",
        "2048",
        "--max-model-len",
        "4096",
        "--json",
        *HOST,
    )
    vllm = ferry(
        "plan",
        str(QWEN3_30B),
        "--gpu-memory",
        "80GiB",
        "--gpu-memory-utilization",
        "0.8",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "2048",
        "--max-model-len",
        "4096",
        "--json",
        *HOST,
    )
    sglang = ferry(
        "plan",
        "--model",
        str(QWEN3_30B),
        "--gpu-memory",
        "80GiB",
        "--mem-fraction-static",
        "0.8",
        "--max-running-requests",
        "8",
        "--max-prefill-tokens",
        "2048",
        "--context-length",
        "4096",
        "--json",
        *HOST,
    )
    assert ours.returncode == vllm.returncode == sglang.returncode == 0, ours.stderr + vllm.stderr + sglang.stderr
    assert json.loads(ours.stdout) == json.loads(vllm.stdout) == json.loads(sglang.stdout)
    plan = json.loads(ours.stdout)
    # an explicit ratio sets its own headroom aside: only the estimated context and late kernels come off it
    outside = CUDA_CONTEXT_ESTIMATE + LATE_MODULES_MARGIN
    assert plan["budget_bytes"] == int(80 * 2**30 * 0.8) - outside and plan["max_running_requests"] == 8


def test_the_model_is_given_once_positionally_or_by_flag():
    missing = ferry("plan", "--gpu-memory", "24GiB")
    assert missing.returncode == 2 and "ferry plan MODEL" in missing.stderr and "--model MODEL" in missing.stderr
    twice = ferry("plan", str(QWEN3_30B), "--model", str(QWEN3_6_35B), "--gpu-memory", "24GiB")
    assert twice.returncode == 2 and "two models given" in twice.stderr


# ---- a newcomer's first plans ------------------------------------------------------------------------------


def test_the_model_may_be_given_as_its_config_json():
    by_dir = ferry("plan", str(QWEN3_30B), "--gpu-memory", "24GiB", "--json", *HOST)
    by_file = ferry("plan", str(QWEN3_30B / "config.json"), "--gpu-memory", "24GiB", "--json", *HOST)
    assert by_dir.returncode == by_file.returncode == 0, by_file.stderr
    assert json.loads(by_file.stdout) == json.loads(by_dir.stdout)


def test_another_file_is_refused_with_what_to_give(tmp_path):
    (tmp_path / "model.safetensors").write_text("")
    out = ferry("plan", str(tmp_path / "model.safetensors"), "--gpu-memory", "24GiB")
    assert out.returncode == 2 and "is a file: give the model directory" in out.stderr


def test_on_a_host_without_a_gpu_everything_missing_is_said_at_once():
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-m", "ferry.services.cli", "plan"], capture_output=True, text=True, timeout=120, env=no_gpu
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "ferry plan MODEL" in out.stderr and "--model MODEL" in out.stderr and "--gpu-memory" in out.stderr


def _plan_here(monkeypatch, capsys, mem_available, *argv, local_gpu=None):
    """`ferry plan` in this process, on a machine with `mem_available` bytes of MemAvailable."""
    from ferry.plan import plan_command
    from ferry.services.cli import main

    monkeypatch.setattr(plan_command, "mem_available_bytes", lambda: mem_available)
    monkeypatch.setattr(plan_command, "_local_free_memory", lambda: local_gpu)
    status = main(["plan", str(QWEN3_30B), *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_plan_for_another_machine_needs_only_gpu_memory_and_says_its_host_ram_is_not_checked(monkeypatch, capsys):
    """24 GiB offloads Qwen3-30B-A3B: its packed banks need 40.82 GiB + the 2 GiB reserve. On a
    laptop of 8 GiB that used to fail the plan, asking for --host-memory."""
    status, out, err = _plan_here(monkeypatch, capsys, 8 * 2**30, "--gpu-memory", "24GiB", "--json")
    assert status == 0, err
    host = json.loads(out)["host"]
    assert host["available_source"] == "not checked" and host["available_bytes"] is None
    assert host["expert_bank_bytes"] > 8 * 2**30
    status, out, err = _plan_here(monkeypatch, capsys, 8 * 2**30, "--gpu-memory", "24GiB")
    row = next(r for r in out.splitlines() if r.startswith("host: available"))
    assert status == 0 and "not checked" in row and "8.00 GiB" in row and "--host-memory" in row
    # enough RAM here: checked against it, as before
    status, out, _ = _plan_here(monkeypatch, capsys, 256 * 2**30, "--gpu-memory", "24GiB", "--json")
    assert status == 0 and json.loads(out)["host"]["available_source"] == "MemAvailable"
    # --host-memory too small, or a plan for this machine's own GPU: still a plan error (rule 4)
    status, _, err = _plan_here(monkeypatch, capsys, 8 * 2**30, "--gpu-memory", "24GiB", "--host-memory", "16GiB")
    assert status == 2 and "do not fit in host RAM" in err
    status, _, err = _plan_here(monkeypatch, capsys, 8 * 2**30, local_gpu=24 * 2**30)
    assert status == 2 and "do not fit in host RAM" in err and "this machine has 8.00 GiB" in err


def test_the_expert_pool_names_every_byte(monkeypatch, capsys):
    """`expert slots 4.77 GiB: 511 of 6144 experts; 9437184 B/slot` was 288 MiB more than 511 x 9437184:
    the prefill's staging slots and the device cache's state, unnamed. Table and JSON name them."""
    status, out, err = _plan_here(monkeypatch, capsys, 256 * 2**30, "--gpu-memory", "16GiB", "--json")
    assert status == 0, err
    e = json.loads(out)["experts"]
    assert 0 < e["slots"] < e["total"]  # offloads
    assert e["staging_slots"] == 32 and e["staging_bytes"] == 32 * e["bytes_per_slot"]  # 288 MiB of 9437184 B experts
    assert e["cache_state_bytes"] > 0 and 0 <= e["padding_bytes"] < 2 * 2**20 + 64 * 256
    assert (
        e["slots"] * e["bytes_per_slot"] + e["staging_bytes"] + e["cache_state_bytes"] + e["padding_bytes"]
        == e["bytes"]
    )
    status, table, _ = _plan_here(monkeypatch, capsys, 256 * 2**30, "--gpu-memory", "16GiB")
    rows = {re.split(r"\s{2,}", r.strip())[0]: r for r in table.splitlines()}
    for name, nbytes in (
        ("expert pool", e["bytes"]),
        ("expert slots", e["slots"] * e["bytes_per_slot"]),
        ("prefill staging slots", e["staging_bytes"]),
        ("expert cache state", e["cache_state_bytes"]),
        ("alignment", e["padding_bytes"]),
    ):
        assert f" {nbytes} " in rows[name], (name, rows.get(name))
    assert f"{e['staging_slots']} x {e['bytes_per_slot']} B" in rows["prefill staging slots"]
    # every expert resident: the pool is its slots (and alignment), nothing to name
    status, out, _ = _plan_here(
        monkeypatch, capsys, 256 * 2**30, "--gpu-memory", "80GiB", "--moe-cache-rate", "1.0", "--json"
    )
    e = json.loads(out)["experts"]
    assert (e["staging_slots"], e["staging_bytes"], e["cache_state_bytes"]) == (0, 0, 0)
    assert e["slots"] * e["bytes_per_slot"] + e["padding_bytes"] == e["bytes"]
