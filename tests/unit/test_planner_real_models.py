"""The planner on the two published configs: hand arithmetic, and the reported failure as a regression."""

import pytest

from ferry.plan.costs import resident_weight_bytes_from_shapes, workspace_bytes_estimate
from ferry.plan.model_config import load_model_config
from ferry.plan.planner import Measured, PlanRequest, make_plan, resolve
from ferry.shared.errors import PlanError
from ferry.shared.units import GiB, round_up
from tests.helpers import QWEN3_6_35B, QWEN3_30B

MiB2 = 2 * 2**20


def _measured(spec, req):
    r = resolve(spec, req)
    return Measured(
        weights_bytes=resident_weight_bytes_from_shapes(spec, r.dtype),
        workspace_bytes=workspace_bytes_estimate(
            spec, r.dtype, r.max_prefill_tokens, r.max_running_requests, r.max_model_len
        ),
    )


def plan(spec, **flags):
    req = PlanRequest(**flags)
    return make_plan(spec, req, _measured(spec, req))


def test_qwen3_30b_costs_by_hand():
    spec = load_model_config(QWEN3_30B)
    p = plan(spec, gpu_memory=24 * GiB)
    # K and V x 48 layers x 4 KV heads x 128 head dim x 2 bytes (bf16)
    assert p.kv.bytes_per_token == 2 * 48 * 4 * 128 * 2 == 98_304
    # gate + up + down: 3 x moe_intermediate 768 x hidden 2048 x 2 bytes
    assert p.experts.bytes_per_slot == 3 * 768 * 2048 * 2 == 9_437_184
    assert p.experts.total == 48 * 128
    assert p.linear_state.slots == p.linear_state.bytes == p.linear_state.bytes_per_slot == 0
    assert p.linear_state.padding_slots == 0
    # KV pool: (pages + 1 sentinel) x 16 tokens x bytes/token, rounded up to the 2 MiB pool granule
    assert p.kv.bytes == round_up((p.kv.pages + 1) * 16 * 98_304, MiB2)


def test_qwen3_6_35b_costs_by_hand():
    spec = load_model_config(QWEN3_6_35B)
    p = plan(spec, gpu_memory=24 * GiB, max_model_len=32768, max_running_requests=16)
    # only the 10 gated-attention layers keep KV: 2 x 10 x 2 KV heads x 256 x 2 bytes
    assert p.kv.bytes_per_token == 2 * 10 * 2 * 256 * 2 == 20_480
    assert p.experts.bytes_per_slot == 3 * 512 * 2048 * 2 == 6_291_456
    assert p.experts.total == 40 * 256
    # per Gated DeltaNet layer: conv state (2*16*128 + 32*128 channels) x 3 taps x 2 bytes,
    # plus float32 recurrent state 32 heads x 128 x 128 x 4 bytes; 30 such layers
    per_slot = 30 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)
    assert p.linear_state.bytes_per_slot == per_slot == 64_389_120
    assert (p.linear_state.slots, p.linear_state.padding_slots) == (16, 1)
    assert p.linear_state.bytes == round_up(17 * per_slot, MiB2)


def test_reported_failure_num_tokens_is_a_requirement_experts_fill_the_rest():
    """An explicit --num-tokens was once treated as a floor the expert fill ignored: the KV pool
    then did not fit beside the experts and the engine died with a CUDA OOM at boot."""
    spec = load_model_config(QWEN3_30B)
    p = plan(spec, gpu_memory=24 * GiB, num_tokens=131_072)
    assert p.kv.tokens == 131_072 and p.kv.pages == 131_072 // 16 and p.kv.sentinel_pages == 1
    assert p.total_bytes <= p.budget_bytes
    # experts take what remains: one more slot would not fit
    assert p.headroom_bytes < p.experts.bytes_per_slot
    assert p.experts.min_slots < p.experts.slots < p.experts.total
    floor = plan(spec, gpu_memory=24 * GiB, kv_reserve_tokens=131_072)
    assert floor.kv == p.kv and floor.experts == p.experts


def test_num_tokens_that_cannot_fit_names_only_that_flag_and_the_largest_value():
    spec = load_model_config(QWEN3_30B)
    with pytest.raises(PlanError) as err:
        plan(spec, gpu_memory=24 * GiB, num_tokens=400_000)
    message = str(err.value)
    assert "--num-tokens" in message and "--gpu-memory" in message  # both were set by the user
    for unset in ("--kv-reserve-tokens", "--moe-cache", "--max-model-len", "--max-running-requests", "--page-size"):
        assert unset not in message
    largest = int(message.split("--num-tokens: the largest value that fits is ")[1].split()[0])
    ok = plan(spec, gpu_memory=24 * GiB, num_tokens=largest)
    assert ok.kv.tokens == largest and ok.experts.slots == ok.experts.min_slots
    with pytest.raises(PlanError):
        plan(spec, gpu_memory=24 * GiB, num_tokens=largest + 1)


def test_hybrid_plan_fits_24gib_with_reasonable_flags():
    spec = load_model_config(QWEN3_6_35B)
    p = plan(spec, gpu_memory=24 * GiB, max_model_len=65536, max_running_requests=32)
    assert p.total_bytes + p.headroom_bytes == p.budget_bytes
    assert p.kv.tokens >= 65536 and p.experts.slots > p.experts.min_slots
