"""KV layer groups (plan/kv_groups.py): gpt-oss-120b's sliding layers priced at their rings, the ring's size and
addressing, rings taken only where smaller (and, sized for a sliding slice, at the defaults for gpt-oss and
Gemma-4), the pools allocated as planned, `ferry plan` showing the groups, and the scheduler's slots and prefix
cache under rings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ferry.plan import pool_layout as L
from ferry.plan.kv_groups import SLIDING_SLICE_TOKENS, KvGroup, kv_groups, ring_page, ring_pages, uses_ring
from ferry.plan.model_config import parse_model_config
from ferry.plan.plan_report import plan_table
from ferry.plan.planner import Measured, PlanRequest, make_plan
from ferry.services.scheduler.batcher import BatchScheduler
from ferry.services.worker.pools import allocate_pools
from ferry.shared.messages import PoolReport
from ferry.shared.sampling import SamplingParams
from ferry.shared.units import MiB

MODELS = Path(__file__).resolve().parents[1] / "data/models"
GPT_OSS_120B = MODELS / "gpt-oss-120b/config.json"
FACTS = Measured(weights_bytes=10 * 2**30, workspace_bytes=2 * 2**30)


def _gpt_oss(config: Path = GPT_OSS_120B):
    raw = json.loads(config.read_text())
    raw.pop("quantization_config")
    return raw, parse_model_config(raw)


_gpt_oss_120b = _gpt_oss


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def test_gpt_oss_120b_has_a_full_and_a_sliding_group_of_18_layers():
    raw, spec = _gpt_oss_120b()
    full, sliding = kv_groups(spec)
    assert full == KvGroup(tuple(range(1, 36, 2)), 8, 64, 0)
    assert sliding == KvGroup(tuple(range(0, 36, 2)), 8, 64, raw["sliding_window"])


def test_gpt_oss_120b_prices_its_sliding_layers_at_their_rings():
    """At 131,072 tokens of context, 4 running requests and an 8,192-token chunk, the sliding half of the KV is
    5 rings (4 requests and the padding one) of ceil((128 - 1 + 512) / 16) = 40 pages (a sliding slice of 512
    tokens) instead of the context's 8,193 pages: the pool drops by 18 layers x 2048 B a token x 16 tokens a
    page x (8193 - 200) pages, up to the pool's 2 MiB rounding."""
    raw, spec = _gpt_oss_120b()
    layers, kv_heads, head_dim = raw["num_hidden_layers"], raw["num_key_value_heads"], raw["head_dim"]
    token_bytes_per_layer = 2 * kv_heads * head_dim * 2  # K and V, bf16
    flags = dict(gpu_memory=200 * 2**30, num_tokens=131072, max_running_requests=4, max_prefill_tokens=8192)
    plan = make_plan(spec, PlanRequest(**flags), FACTS)
    context_pages = 131072 // 16 + 1  # and the sentinel
    ring = -(-(raw["sliding_window"] - 1 + 512) // 16)
    assert ring == 40 and SLIDING_SLICE_TOKENS == 512
    full_bytes = layers // 2 * token_bytes_per_layer * 16 * context_pages
    ring_bytes = layers // 2 * token_bytes_per_layer * 16 * (4 + 1) * ring
    everything_paged = layers * token_bytes_per_layer * 16 * context_pages
    assert plan.kv.bytes == _round_up(full_bytes + ring_bytes, 2 * MiB)
    assert everything_paged - plan.kv.bytes == pytest.approx(
        layers // 2 * token_bytes_per_layer * 16 * (context_pages - 5 * ring), abs=2 * MiB
    )
    assert plan.kv.ring_slots == 4 and plan.kv.ring_slice_tokens == 512
    assert plan.kv.bytes_per_token == layers // 2 * token_bytes_per_layer  # a token of context: the full layers'
    by_window = {g.window: g for g in plan.kv.groups}
    assert by_window[128].ring_pages == ring and by_window[128].pages == 5 * ring
    assert by_window[0].ring_pages == 0 and by_window[0].pages == context_pages
    assert by_window[128].bytes == ring_bytes and by_window[0].bytes == full_bytes


def test_a_ring_is_taken_only_where_it_is_smaller_than_the_context():
    """64 running requests' rings (65 x 40 pages) are more than 32,768 tokens of context: that group stays paged
    over the context, as every layer was, and the plan is what it was before groups."""
    raw, spec = _gpt_oss_120b()
    flags = dict(gpu_memory=200 * 2**30, num_tokens=32768, max_running_requests=64, max_prefill_tokens=8192)
    plan = make_plan(spec, PlanRequest(**flags), FACTS)
    assert plan.kv.ring_slots == 0 and all(g.ring_pages == 0 for g in plan.kv.groups)
    per_page = raw["num_hidden_layers"] * 2 * 8 * 64 * 2 * 16
    assert plan.kv.bytes == _round_up(per_page * (32768 // 16 + 1), 2 * MiB)
    assert plan.kv.bytes_per_token == L.kv_bytes_per_token(spec, "bfloat16")
    assert "2049 pages over the context (rings for 64 requests would take 2600)" in plan_table(plan)


@pytest.mark.parametrize("window,step,page_size", [(8, 9, 4), (128, 8192, 16), (1024, 1, 16), (5, 3, 1), (7, 64, 16)])
def test_a_ring_holds_a_steps_keys_and_one_page_less_would_not(window, step, page_size):
    """Every position from the oldest key a step's first token sees to its last token has a row of its own, for
    any step start; one page fewer has fewer rows than those positions."""
    pages = ring_pages(window, step, page_size)
    span = window - 1 + step
    assert pages * page_size >= span > (pages - 1) * page_size
    for start in range(window - 1, window - 1 + 2 * pages * page_size, max(1, pages * page_size // 16 + 1)):
        positions = range(start - window + 1, start + step)
        rows = {ring_page(3, p, pages, page_size) * page_size + p % page_size for p in positions}
        assert len(rows) == span
        assert all(3 * pages * page_size <= r < 4 * pages * page_size for r in rows)  # inside slot 3's ring


@pytest.mark.parametrize("model", ["gpt-oss-120b", "gpt-oss-20b"])
def test_gpt_oss_sliding_layers_take_rings_at_the_default_requests_and_chunk(model):
    """At the defaults (64 running requests, 8,192-token chunks) and a max_model_len of context, rings sized for a
    whole chunk were more pages than the context (65 x ceil((128 - 1 + 8192) / 16) > 8193) and the sliding
    layers stayed paged; sized for a 512-token sliding slice they are 65 x 40 pages, each sliding layer's K/V
    drops from the context's to the rings', all computed from the published config.json."""
    raw, spec = _gpt_oss(MODELS / model / "config.json")
    page, context_tokens = 16, raw["max_position_embeddings"]
    plan = make_plan(spec, PlanRequest(gpu_memory=200 * 2**30, num_tokens=context_tokens), FACTS)
    assert (plan.max_running_requests, plan.max_prefill_tokens, plan.kv.page_size) == (64, 8192, page)  # defaults
    sliding = raw["layer_types"].count("sliding_attention")
    full = raw["num_hidden_layers"] - sliding
    assert sliding == full == raw["num_hidden_layers"] // 2
    token_bytes = 2 * raw["num_key_value_heads"] * raw["head_dim"] * 2  # K and V of a layer, bf16
    context_pages = context_tokens // page + 1
    rings = (64 + 1) * -(-(raw["sliding_window"] - 1 + 512) // page)
    assert (64 + 1) * -(-(raw["sliding_window"] - 1 + 8192) // page) > context_pages > rings == 2600
    paged = raw["num_hidden_layers"] * token_bytes * page * context_pages  # before: every layer over the context
    planned = full * token_bytes * page * context_pages + sliding * token_bytes * page * rings
    assert plan.kv.bytes == _round_up(planned, 2 * MiB)
    assert paged - plan.kv.bytes == pytest.approx(sliding * token_bytes * page * (context_pages - rings), abs=2 * MiB)
    assert plan.kv.ring_slots == 64 and plan.kv.ring_slice_tokens == 512
    assert {g.window: g.pages for g in plan.kv.groups} == {0: context_pages, raw["sliding_window"]: rings}


def test_gemma4_sliding_layers_take_rings_at_the_default_requests_and_chunk():
    """Gemma-4's window of 1024: rings for a whole chunk were 65 x ceil((1024 - 1 + 8192) / 16) = 37,440 pages,
    more than 131,072 tokens' 8,193; for a 512-token slice 65 x 96 = 6,240, fewer, so its sliding layers (8 kv
    heads of 256) take them."""
    spec = _gemma4_like()
    flags = dict(gpu_memory=2**40, num_tokens=131072, moe_cache_size=24)
    plan = make_plan(spec, PlanRequest(**flags), Measured(weights_bytes=0, workspace_bytes=0))
    assert (plan.max_running_requests, plan.max_prefill_tokens) == (64, 8192)
    context_pages, rings = 131072 // 16 + 1, 65 * -(-(1024 - 1 + 512) // 16)
    assert 65 * -(-(1024 - 1 + 8192) // 16) > context_pages > rings == 6240
    full_bytes = 1 * 2 * context_pages * 16 * 2 * 512 * 2
    sliding_paged, sliding_rings = (5 * 2 * pages * 16 * 8 * 256 * 2 for pages in (context_pages, rings))
    assert plan.kv.bytes == _round_up(full_bytes + sliding_rings, 2 * MiB)
    assert full_bytes + sliding_paged - plan.kv.bytes == pytest.approx(sliding_paged - sliding_rings, abs=2 * MiB)


def test_no_ring_without_slots_or_a_window():
    sliding, full = KvGroup((0,), 2, 8, 4), KvGroup((1,), 2, 8, 0)
    assert uses_ring(sliding, 1000, 4, 8, 4) and not uses_ring(sliding, 1000, 0, 8, 4)
    assert not uses_ring(sliding, 1000, 4, 0, 4)  # no slice: nothing for a ring layer to run over
    assert not uses_ring(full, 1000, 4, 8, 4)
    assert not uses_ring(sliding, (4 + 1) * ring_pages(4, 8, 4), 4, 8, 4)  # as many pages: stays paged


@pytest.mark.parametrize("chunk,slice_tokens", [(64, 64), (2048, 512)])
def test_pools_with_rings_are_allocated_exactly_as_planned(chunk, slice_tokens):
    """Rings sized for the chunk where it is shorter than a sliding slice, else for the slice; the ring layers
    run over a step in slices of that many tokens."""
    raw, spec = _gpt_oss_120b()
    shrunk = dict(num_hidden_layers=4, layer_types=raw["layer_types"][:4], vocab_size=512, hidden_size=64)
    small = parse_model_config(raw | shrunk | dict(intermediate_size=32, num_local_experts=4, experts_per_token=2))
    flags = dict(gpu_memory=2**40, num_tokens=8192, max_running_requests=3, max_prefill_tokens=chunk, moe_cache_size=16)
    plan = make_plan(small, PlanRequest(**flags), Measured(weights_bytes=0, workspace_bytes=0))
    assert plan.kv.ring_slots == 3 and plan.kv.ring_slice_tokens == slice_tokens
    pools = allocate_pools(small, plan, "cpu")
    assert pools.kv.pool.nbytes == plan.kv.bytes
    full, sliding = (g for g in plan.kv.groups)
    ring = -(-(128 - 1 + slice_tokens) // 16)
    k, _ = pools.kv.layer(0)  # a sliding layer: its group's rings
    assert k.shape == (4 * ring, 16, 8, 64) and pools.kv.ring_pages(0) == sliding.ring_pages == ring
    assert pools.kv.slice_tokens(0) == slice_tokens
    k, _ = pools.kv.layer(1)
    assert k.shape == (8192 // 16 + 1, 16, 8, 64) and pools.kv.ring_pages(1) == 0 and pools.kv.slice_tokens(1) == 0


def test_ferry_plan_shows_each_group_and_its_rings():
    _, spec = _gpt_oss_120b()
    flags = dict(gpu_memory=200 * 2**30, num_tokens=131072, max_running_requests=4, max_prefill_tokens=8192)
    table = plan_table(make_plan(spec, PlanRequest(**flags), FACTS))
    assert "KV group: full attention" in table and "18 layers x 8 kv heads x 64; 8193 pages over the context" in table
    assert "KV group: sliding window 128" in table
    assert "4 + 1 padding rings x 40 pages (window + 512-token slice)" in table


def _scheduler(rings: int) -> BatchScheduler:
    pool = PoolReport(
        kv_pages=64,
        page_size=4,
        linear_state_slots=0,
        max_running_requests=3,
        max_prefill_tokens=32,
        max_model_len=128,
        kv_ring_slots=rings,
    )
    return BatchScheduler(pool, prefill_coalesce_s=0)


def test_the_scheduler_gives_each_running_request_a_ring_slot_and_reuses_no_prefix():
    prompt = np.arange(1, 9, dtype=np.int32)
    for rings, expect_reuse in ((3, False), (0, True)):
        s = _scheduler(rings)
        assert s.kv.prefix_reuse == expect_reuse
        for rid in range(3):
            s.add(rid, b"c", rid, prompt, SamplingParams(), 4)
        step = s.schedule()
        slots = sorted(step.linear_state_slots.tolist())
        # with rings each computes the prompt whole in its own ring; without, the others wait for its pages
        assert slots == ([1, 2, 3] if rings else [0])


def test_the_worker_refuses_a_slot_past_its_rings():
    import msgspec

    from ferry.shared.contract import StepLimits, step_problems

    s = _scheduler(3)
    s.add(0, b"c", 0, np.arange(1, 9, dtype=np.int32), SamplingParams(), 4)
    step = s.schedule()
    limits = StepLimits(
        kv_pages=64, page_size=4, linear_state_slots=0, max_running_requests=3, max_prefill_tokens=32,
        max_model_len=128, vocab_size=0, kv_ring_slots=3,
    )  # fmt: skip
    assert step_problems(step, limits, set()) == []
    past = msgspec.structs.replace(step, linear_state_slots=np.array([4], dtype=np.int32))
    assert "linear-state slots must be in 0..3" in step_problems(past, limits, set())


def _gemma4_like():
    """Gemma-4-26B-A4B's attention shapes (gemma-4-26b-a4b/config.json) on 6 layers: five sliding ones over a window of
    1024 with 8 kv heads of 256, then a full one with 2 kv heads of 512; small experts."""
    _, spec = _gpt_oss_120b()
    full = "full_attention"
    return dataclasses.replace(
        spec,
        num_layers=6,
        layer_types=(full,) * 6,
        moe_layers=(True,) * 6,
        attention_windows=(1024,) * 5 + (0,),
        attention_kv_heads=(8,) * 5 + (2,),
        attention_head_dims=(256,) * 5 + (512,),
        hidden_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        vocab_size=512,
    )


def test_groups_of_different_shapes_are_each_priced_and_allocated_at_their_own_shape():
    spec = _gemma4_like()
    full, sliding = kv_groups(spec)
    assert (full.layers, full.kv_heads, full.head_dim, full.window) == ((5,), 2, 512, 0)
    assert (sliding.layers, sliding.kv_heads, sliding.head_dim, sliding.window) == ((0, 1, 2, 3, 4), 8, 256, 1024)
    flags = dict(gpu_memory=2**40, num_tokens=4096, max_running_requests=2, max_prefill_tokens=64, moe_cache_size=24)
    plan = make_plan(spec, PlanRequest(**flags), Measured(weights_bytes=0, workspace_bytes=0))
    ring = -(-(1024 - 1 + 64) // 16)
    full_bytes = 1 * 2 * (4096 // 16 + 1) * 16 * 2 * 512 * 2
    ring_bytes = 5 * 2 * (2 + 1) * ring * 16 * 8 * 256 * 2
    assert plan.kv.bytes == _round_up(full_bytes + ring_bytes, 2 * MiB)  # the first tensor ends on 256 B
    assert plan.kv.bytes_per_token == 2 * 2 * 512 * 2  # a token of context: the full layer's
    pools = allocate_pools(spec, plan, "cpu")
    assert pools.kv.pool.nbytes == plan.kv.bytes
    assert pools.kv.layer(5)[0].shape == (4096 // 16 + 1, 16, 2, 512) and pools.kv.ring_pages(5) == 0
    assert pools.kv.layer(2)[1].shape == (3 * ring, 16, 8, 256) and pools.kv.ring_pages(2) == ring
    assert pools.kv.gather_for(5) is not None and pools.kv.gather_for(2) is None  # the buffers are the full shape's
