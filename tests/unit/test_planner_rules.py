"""docs/ARCHITECTURE.md §2 rules on a small synthetic model: sentinels priced, exact fit, error text, flag handling."""

import pytest

from ferry.plan import pool_layout as L
from ferry.plan.model_config import parse_model_config
from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.services.worker.pools import allocate_pools
from ferry.shared.errors import ConfigError, PlanError

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
    "torch_dtype": "float32",
}
SPEC = parse_model_config(TINY)
# experts of 1.5 MiB each, 64 in all: budgets of tens of MB hold some of them, not all
SPEC_BIG = parse_model_config(
    TINY | {"hidden_size": 256, "moe_intermediate_size": 512, "num_experts": 16, "num_hidden_layers": 4}
)
FACTS = Measured(weights_bytes=300_000, workspace_bytes=2_000_000)


def test_a_budget_of_exactly_the_total_plans_and_allocates_within_it_one_byte_less_fails():
    flags = dict(memory_ratio=1.0, num_pages=40, moe_cache_size=12, page_size=4)
    reference = make_plan(SPEC, PlanRequest(gpu_memory=10**9, **flags), FACTS)
    exact = make_plan(SPEC, PlanRequest(gpu_memory=reference.total_bytes, **flags), FACTS)
    assert exact.headroom_bytes == 0 and exact.total_bytes == exact.budget_bytes
    assert exact.kv.sentinel_pages == 1
    pools = allocate_pools(SPEC, exact, "cpu")
    assert FACTS.weights_bytes + FACTS.workspace_bytes + pools.nbytes == exact.total_bytes
    assert pools.kv.kv.shape[2] == 40 + 1  # the sentinel page is really there
    with pytest.raises(PlanError, match="over"):
        make_plan(SPEC, PlanRequest(gpu_memory=reference.total_bytes - 1, **flags), FACTS)


def test_requirement_and_floor_give_the_same_kv_when_experts_do_not_all_fit():
    spec = SPEC_BIG
    budget = 60_000_000  # 18 of 64 expert slots, and the 16 prefill staging slots
    req = make_plan(spec, PlanRequest(gpu_memory=budget, memory_ratio=1.0, num_tokens=1024), FACTS)
    floor = make_plan(spec, PlanRequest(gpu_memory=budget, memory_ratio=1.0, kv_reserve_tokens=1024), FACTS)
    assert req.experts.slots < req.experts.total
    assert req.kv == floor.kv and req.experts == floor.experts


def test_automatic_fill_gives_every_expert_then_kv():
    p = make_plan(SPEC, PlanRequest(gpu_memory=10**9, memory_ratio=1.0), FACTS)
    assert p.experts.slots == p.experts.total == 3 * 8
    assert p.kv.tokens > 512 and p.headroom_bytes < 2 * 2**20 + p.kv.bytes_per_token * 16


def test_error_with_no_flags_set_names_no_flag_to_lower():
    with pytest.raises(PlanError) as err:
        make_plan(SPEC, PlanRequest(), Measured(10**9, 10**6, free_bytes=10**9))
    text = str(err.value)
    assert "free device memory" in text and "(measured)" in text
    assert "largest value" not in text and "--" not in text.split("terms:")[1]


def test_gpu_memory_over_free_memory_is_refused():
    with pytest.raises(PlanError, match="--gpu-memory .* more than the device has free"):
        make_plan(SPEC, PlanRequest(gpu_memory=2 * 10**9), Measured(1, 1, free_bytes=10**9))


def test_without_a_device_the_budget_must_be_given():
    with pytest.raises(ConfigError, match="--gpu-memory"):
        make_plan(SPEC, PlanRequest(), FACTS)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(num_tokens=16, num_pages=4), "--num-tokens and --num-pages"),
        (dict(moe_cache_size=8, moe_cache_rate=0.5), "--moe-cache-size and --moe-cache-rate"),
        (dict(moe_cache_size=4), "fewer than the 8 the offload loop needs"),
        (dict(moe_cache_size=25), "only 24 experts"),
        (dict(moe_cache_rate=1.5), "--moe-cache-rate must be in"),
        (dict(max_model_len=100_000), "--max-model-len 100000 exceeds"),
        (dict(page_size=0), "--page-size"),
        (dict(dtype="int4"), "--dtype"),
    ],
)
def test_bad_flags_are_named(flags, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(SPEC, PlanRequest(gpu_memory=10**9, **flags), FACTS)


def test_moe_cache_rate_rounds_up_to_whole_slots():
    p = make_plan(SPEC, PlanRequest(gpu_memory=10**9, moe_cache_rate=0.5), FACTS)
    assert p.experts.slots == 12


def test_moe_cache_size_that_cannot_fit_says_the_largest_that_does():
    flags = dict(memory_ratio=1.0, num_pages=8, page_size=4)
    budget = make_plan(SPEC_BIG, PlanRequest(gpu_memory=10**9, moe_cache_size=20, **flags), FACTS).total_bytes
    with pytest.raises(PlanError) as err:
        make_plan(SPEC_BIG, PlanRequest(gpu_memory=budget, moe_cache_size=40, **flags), FACTS)
    largest = int(str(err.value).split("--moe-cache-size: the largest value that fits is ")[1].split()[0])
    assert 20 <= largest < 40
    make_plan(SPEC_BIG, PlanRequest(gpu_memory=budget, moe_cache_size=largest, **flags), FACTS)
    with pytest.raises(PlanError):
        make_plan(SPEC_BIG, PlanRequest(gpu_memory=budget, moe_cache_size=largest + 1, **flags), FACTS)


def test_memory_ratio_hint_when_the_user_set_it():
    flags = dict(num_pages=40, moe_cache_size=12, page_size=4)
    total = make_plan(SPEC, PlanRequest(gpu_memory=10**9, **flags), FACTS).total_bytes
    with pytest.raises(PlanError) as err:
        make_plan(SPEC, PlanRequest(gpu_memory=total, memory_ratio=0.5, **flags), FACTS)
    assert "--memory-ratio would have to be at least 1" in str(err.value)
    make_plan(SPEC, PlanRequest(gpu_memory=total, memory_ratio=1.0, **flags), FACTS)


def test_kv_takes_the_rest_when_the_expert_cache_size_is_fixed():
    for flags in (dict(moe_cache_size=32), dict(moe_cache_rate=0.5)):
        p = make_plan(SPEC_BIG, PlanRequest(gpu_memory=400_000_000, memory_ratio=1.0, **flags), FACTS)
        assert p.experts.slots == 32 and p.kv.tokens > 512
        assert p.headroom_bytes < L.kv_bytes_per_token(SPEC_BIG, p.dtype) * p.kv.page_size + 2 * 2**20
