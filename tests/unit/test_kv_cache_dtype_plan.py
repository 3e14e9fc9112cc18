"""--kv-cache-dtype fp8 in the plan: e4m3 values and one float32 scale per (token, kv head) row for K and V,
priced exactly by pool_layout and allocated as priced (docs/ARCHITECTURE.md §2 rule 1)."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from ferry.plan import pool_layout as L
from ferry.plan.costs import resident_weight_bytes_from_shapes, workspace_bytes_estimate
from ferry.plan.model_config import load_model_config, parse_model_config
from ferry.plan.planner import Measured, PlanRequest, make_plan, resolve
from ferry.services.worker.pools import PoolAllocationError, allocate_pools
from ferry.shared.errors import ConfigError, PlanError
from ferry.shared.units import GiB, round_up
from tests.helpers import QWEN3_6_35B

TINY = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "max_position_embeddings": 512,
    "torch_dtype": "bfloat16",
}
SPEC = parse_model_config(TINY)
FACTS = Measured(weights_bytes=300_000, workspace_bytes=2_000_000)
MiB2 = 2 * 2**20


def test_fp8_kv_is_priced_as_its_values_and_scales_with_the_same_sentinel_and_alignment():
    p = make_plan(
        SPEC, PlanRequest(gpu_memory=10**9, memory_ratio=1.0, num_pages=40, page_size=4, kv_cache_dtype="fp8"), FACTS
    )
    rows = 3 * 2 * 2  # layers x (K, V) x kv heads
    assert p.kv.bytes_per_token == rows * (8 * 1 + 4) == 144 and p.kv.scale_bytes_per_token == rows * 4
    assert (p.kv.cache_dtype, p.kv.value_dtype) == ("fp8", "float8_e4m3fn")
    values = 41 * 4 * rows * 8  # 40 pages + the sentinel, e4m3
    scales = 41 * 4 * rows * 4  # float32, at the next view boundary
    assert p.kv.bytes == round_up(round_up(values, L.VIEW_ALIGN) + scales, MiB2)
    bf16 = make_plan(SPEC, PlanRequest(gpu_memory=10**9, memory_ratio=1.0, num_pages=40, page_size=4), FACTS)
    assert bf16.kv.bytes_per_token == rows * 8 * 2 and bf16.kv.scale_bytes_per_token == 0
    assert (bf16.kv.cache_dtype, bf16.kv.value_dtype) == ("auto", "bfloat16")
    # an explicit auto is the default plan, field for field
    assert (
        make_plan(
            SPEC,
            PlanRequest(gpu_memory=10**9, memory_ratio=1.0, num_pages=40, page_size=4, kv_cache_dtype="auto"),
            FACTS,
        )
        == bf16
    )


def test_fp8_pool_allocates_exactly_the_plan_at_a_budget_of_exactly_its_total():
    flags = dict(memory_ratio=1.0, num_pages=40, moe_cache_size=12, page_size=4, kv_cache_dtype="fp8")
    reference = make_plan(SPEC, PlanRequest(gpu_memory=10**9, **flags), FACTS)
    exact = make_plan(SPEC, PlanRequest(gpu_memory=reference.total_bytes, **flags), FACTS)
    assert exact.headroom_bytes == 0
    pools = allocate_pools(SPEC, exact, "cpu")
    assert FACTS.weights_bytes + FACTS.workspace_bytes + pools.nbytes == exact.total_bytes
    kv = pools.kv
    assert kv.kv.dtype == torch.float8_e4m3fn and kv.kv.shape == (3, 2, 41, 4, 2, 8)
    assert kv.scale.dtype == torch.float32 and kv.scale.shape == (3, 2, 41, 4, 2)
    assert kv.dtype == torch.bfloat16  # what attention computes in and the gather buffers hold
    k_scale, v_scale = kv.layer_scales(1)
    assert k_scale.shape == (41, 4, 2) and k_scale.data_ptr() == kv.scale[1, 0].data_ptr() != v_scale.data_ptr()
    with pytest.raises(PlanError, match="over"):
        make_plan(SPEC, PlanRequest(gpu_memory=reference.total_bytes - 1, **flags), FACTS)


def test_a_model_dtype_pool_has_no_scales():
    p = make_plan(SPEC, PlanRequest(gpu_memory=10**9, memory_ratio=1.0, num_pages=8), FACTS)
    kv = allocate_pools(SPEC, p, "cpu").kv
    assert kv.scale is None and kv.layer_scales(0) == (None, None) and kv.kv.dtype == torch.bfloat16


def test_worker_refuses_a_kv_pool_other_than_the_priced_one():
    p = make_plan(SPEC, PlanRequest(gpu_memory=10**9, memory_ratio=1.0, num_pages=40_000, kv_cache_dtype="fp8"), FACTS)
    other = dataclasses.replace(p, kv=dataclasses.replace(p.kv, cache_dtype="auto"))
    with pytest.raises(PoolAllocationError, match="kv pool layout"):
        allocate_pools(SPEC, other, "cpu")


def test_an_unknown_kv_cache_dtype_names_the_flag():
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8, got 'fp16'"):
        resolve(SPEC, PlanRequest(kv_cache_dtype="fp16"))


def _plan_262k(spec, kv_cache_dtype):
    req = PlanRequest(gpu_memory=24 * GiB, max_model_len=262_144, kv_cache_dtype=kv_cache_dtype, host_memory=128 * GiB)
    r = resolve(spec, req)
    measured = Measured(
        weights_bytes=resident_weight_bytes_from_shapes(spec, r.dtype),
        workspace_bytes=workspace_bytes_estimate(
            spec, r.dtype, r.max_prefill_tokens, r.max_running_requests, r.max_model_len
        ),
    )
    return make_plan(spec, req, measured)


def test_fp8_kv_at_262k_context_on_24gib_turns_the_saved_bytes_into_expert_slots():
    """Qwen3.6-35B-A3B's published config: 10 full-attention layers of 2 kv heads x 256 keep KV. At a
    262,144-token floor, bf16 KV takes 20,480 B a token (5.37 GB); fp8 10,400 (2.73 GB). The 2.64 GB freed
    go to expert slots of 6.29 MB: 420 more in a 24 GiB budget."""
    spec = load_model_config(QWEN3_6_35B)
    bf16, fp8 = _plan_262k(spec, "auto"), _plan_262k(spec, "fp8")
    assert (bf16.kv.bytes_per_token, fp8.kv.bytes_per_token) == (2 * 10 * 2 * 256 * 2, 2 * 10 * 2 * (256 + 4))
    assert bf16.kv.tokens == fp8.kv.tokens == 262_144  # the floor: one max-length sequence, no more
    freed = bf16.kv.bytes - fp8.kv.bytes
    assert 2.6e9 < freed < 2.7e9
    assert fp8.experts.slots - bf16.experts.slots == freed // fp8.experts.bytes_per_slot == 420
    assert bf16.experts.slots < fp8.experts.slots < fp8.experts.total
    # the linear state of the Gated DeltaNet layers stays in the model dtype: the same pools
    assert fp8.linear_state == bf16.linear_state and fp8.linear_state_snapshots == bf16.linear_state_snapshots


def test_ferry_plan_shows_fp8_kv_in_its_table_and_json():
    def plan(*extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "ferry.services.cli",
                "plan",
                "--model",
                str(QWEN3_6_35B),
                "--gpu-memory",
                "24GiB",
                "--max-model-len",
                "262144",
                "--host-memory",
                "128GiB",
                "--kv-cache-dtype",
                "fp8",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    out = plan("--json")
    assert out.returncode == 0, out.stderr
    kv = json.loads(out.stdout)["kv"]
    assert (kv["cache_dtype"], kv["value_dtype"], kv["bytes_per_token"], kv["scale_bytes_per_token"]) == (
        "fp8",
        "float8_e4m3fn",
        10_400,
        160,
    )
    table = plan()
    assert table.returncode == 0, table.stderr
    assert "10400 B/token (fp8 e4m3, 160 B of it scales)" in table.stdout
    refused = plan("--kv-cache-dtype", "int8")
    assert refused.returncode == 2 and "--kv-cache-dtype" in refused.stderr
