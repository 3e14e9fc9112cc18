"""bench/long_context.py (issue 24's long-prompt benchmark) on CPU: the tiny hybrid served by `ferry serve`, one
prompt of a few hundred tokens through the openai client, the booted plan read from serve's log; and its
bounds against arithmetic done by hand on the full-size Qwen3.6-35B-A3B."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.long_context import _median_tok_s, bounds, crossing_bytes, prefill_flops, streamed_bytes
from ferry.plan.model_config import load_model_config
from tests.helpers import QWEN3_6_35B
from tests.integration.harness import REAL_WORKER_ENV, serve_model

ROOT = Path(__file__).resolve().parents[2]


def test_the_bounds_of_the_issues_prompt_by_hand():
    spec = load_model_config(QWEN3_6_35B)
    L = 261_988
    flops = prefill_flops(spec, L)
    # the issue: the 10 full-attention layers' causal attention is about 5.6 PFLOP (16 heads x 256)
    assert flops["attention_flops"] == pytest.approx(4 * L * (L + 1) / 2 * 16 * 256 * 10)
    assert 5.5e15 < flops["attention_flops"] < 5.7e15
    # and each token multiplies ~2.4 G weights (8 of 256 experts, the shared expert, the projections)
    assert 2.2e9 < flops["linear_flops"] / (2 * L) < 2.6e9
    # 32 chunks of 8192 tokens, each streaming the 8,210 experts without a slot at 24 GiB, packed (4.72 MB)
    packed = crossing_bytes({"host_expert_bank_bytes": 10240 * 4_718_592, "expert_total": 10240}, spec, spec.dtype)
    assert packed == 4_718_592
    moved = streamed_bytes(10240, 2030, packed, L, 8192)
    assert moved == 32 * 8210 * 4_718_592
    b = bounds(flops, moved, 55.0, 700.0)
    assert b["pcie_s"] == pytest.approx(moved / 55e9) and b["bound_s"] == b["pcie_s"]  # ~22.5 s: PCIe paces it
    assert b["compute_s"] == pytest.approx(flops["flops"] / 700e12)
    assert bounds(flops, 0, 55.0, None)["bound_s"] == 0.0  # no matmul rate measured: PCIe only


def test_the_median_rate_counts_the_tokens_a_chunk_carried():
    # 9 tokens in 5 chunks (two tokens a chunk after the first), a median wait of 0.1 s
    assert _median_tok_s({"tokens": 9, "chunks": 5, "median_gap_s": 0.1}) == pytest.approx(20.0)
    assert _median_tok_s({"tokens": 1, "chunks": 1, "median_gap_s": None}) is None


def test_the_long_prompt_bench_runs_against_a_served_model(tiny_models, tmp_path):
    model = tiny_models["qwen3_5_moe"]
    ceilings = tmp_path / "ceilings.json"
    ceilings.write_text(json.dumps({"h2d_pinned_GBps": 55.0, "bf16_matmul_TFLOPs": 700.0}))
    with serve_model(model, tmp_path, REAL_WORKER_ENV, max_model_len=1024) as served:
        out = tmp_path / "long.json"
        cmd = [
            sys.executable,
            "bench/long_context.py",
            "--base-url",
            served.url + "/v1",
            "--config",
            str(model),
            "--serve-log",
            str(served.log_path),
            "--ceilings",
            str(ceilings),
            "--prompt-len",
            "600",
            "--short-len",
            "16",
            "--max-tokens",
            "8",
            "--out",
            str(out),
        ]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["prompt_tokens"] == 600
    assert result["ttft_s"] > 0 and result["prefill_tok_s"] == pytest.approx(600 / result["ttft_s"])
    assert result["decode_after_tok_s"] > 0 and result["decode_short_tok_s"] > 0
    assert result["decode_tokens"] == 8
    # the median step's rate: at least the slowest step's, and a real number beside the mean's
    for which in ("after", "short"):
        assert result[f"decode_{which}_median_tok_s"] > 0
    assert result["decode_after_median_tok_s"] >= 1 / result["max_gap_after_s"] - 1e-9
    # three decode runs each: the long prompt's repeats prefilled from the prefix cache, the figure their median
    after, short = result["decode_after_runs"], result["decode_short_runs"]
    assert len(after) == len(short) == 3
    assert after[0]["median_tok_s"] == result["decode_after_median_tok_s"] and after[0]["cached_tokens"] == 0
    assert all(run["cached_tokens"] >= 600 // 2 for run in after[1:]), after
    assert all(run["ttft_s"] < after[0]["ttft_s"] for run in after[1:]), after
    # from the moment each request left the client: never more than from the call into the client
    assert 0 < result["ttft_wire_s"] <= result["ttft_s"] and result["ttft_wire_s"] == after[0]["ttft_wire_s"]
    assert all(0 < run["ttft_wire_s"] <= run["ttft_s"] for run in after + short), (after, short)
    for which, runs in (("after", after), ("short", short)):
        assert result[f"decode_{which}_repeats_median_tok_s"] == pytest.approx(
            sorted(run["median_tok_s"] for run in runs)[1]
        )
    # every expert of the tiny model has a slot: nothing streams, and the bound is the compute's
    assert result["expert_slots"] == result["expert_total"] and result["streamed_bytes_model"] == 0
    assert result["bound_s"] == pytest.approx(result["compute_s"])
