"""OffloadedExperts against the all-resident store: same bits, misses copied, statistics right."""

import json

import pytest
import torch
from offload_tiny import random_experts, random_routing, slot_pool, tiny_spec

from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.slot_cache.policy import LRUExpertPolicy
from ferry.services.worker.offload.stores.offloaded import OffloadedExperts
from ferry.services.worker.offload.stores.resident import ResidentExperts

SPEC = tiny_spec(layers=3, experts=6, top_k=3)
LAYERS = len(SPEC.moe_layer_indices)


def _stores(num_slots: int, seed: int = 0, pipeline_chunks: int = 2, prefill_tokens: int = 8):
    resident = ResidentExperts(slot_pool(SPEC, LAYERS * SPEC.num_experts), LAYERS, SPEC.num_experts)
    banks = HostBanks.for_model(SPEC, "float32", progress=False)
    policy = LRUExpertPolicy(LAYERS, SPEC.num_experts, num_slots)
    offloaded = OffloadedExperts(
        slot_pool(SPEC, num_slots), banks, policy, "cpu", pipeline_chunks=pipeline_chunks, prefill_tokens=prefill_tokens
    )
    for (layer, e), (gate, up, down) in random_experts(SPEC, seed).items():
        resident.load_expert(layer, e, gate, up, down)
        offloaded.load_expert(layer, e, gate, up, down)
    return resident, offloaded


@pytest.mark.parametrize("num_slots", [6, 7, 10, 17])  # the minimum (one layer) up to all but one expert
def test_offloaded_equals_resident_bit_for_bit_while_missing(num_slots):
    resident, offloaded = _stores(num_slots)
    g = torch.Generator().manual_seed(num_slots)
    steps = [1, 2, 12, 1, 1, 30, 3, 1]  # decode steps and prefill steps (>= 8 tokens: chunked copies)
    looked_up = 0
    for tokens in steps:
        for layer in range(LAYERS):
            x, ids, weights = random_routing(SPEC, tokens, g)
            want = resident.forward(layer, x, ids, weights)
            got = offloaded.forward(layer, x, ids, weights)
            assert torch.equal(got, want), f"step of {tokens} tokens, layer {layer}, {num_slots} slots"
            looked_up += len(torch.unique(ids))
    offloaded.end_step()
    total = offloaded.stats.total
    assert total.misses > 0 and total.hits + total.misses == looked_up
    assert total.steps == len(steps)
    assert total.bytes_copied == total.misses * offloaded.banks.expert_nbytes
    assert total.copy_time_s > 0 and total.exposed_copy_time_s == total.copy_time_s  # CPU: nothing hidden
    # every cached expert's slot holds exactly its bank's weights
    policy = offloaded.policy
    for s in range(num_slots):
        layer, e = int(policy.layer_of_slot[s]), int(policy.expert_of_slot[s])
        assert torch.equal(offloaded.slots.w13[s], offloaded.banks.w13[layer][e])
        assert torch.equal(offloaded.slots.w2[s], offloaded.banks.w2[layer][e])


def test_a_cache_for_every_expert_copies_nothing_after_preload():
    resident, offloaded = _stores(LAYERS * SPEC.num_experts)
    assert offloaded.preload() == LAYERS * SPEC.num_experts
    g = torch.Generator().manual_seed(1)
    for tokens in (1, 40, 1):
        for layer in range(LAYERS):
            x, ids, weights = random_routing(SPEC, tokens, g)
            assert torch.equal(offloaded.forward(layer, x, ids, weights), resident.forward(layer, x, ids, weights))
    offloaded.end_step()
    d = offloaded.stats.to_dict()
    assert d["misses"] == 0 and d["bytes_copied"] == 0 and d["hit_rate"] == 1.0 and d["steps"] == 3


def test_per_step_statistics_and_json_shape():
    _, offloaded = _stores(6)
    g = torch.Generator().manual_seed(2)
    for layer in range(LAYERS):  # step 1: cold cache, every expert a miss
        offloaded.forward(layer, *random_routing(SPEC, 1, g))
    for layer in range(LAYERS):  # step 2 starts when layer 0 comes round again
        offloaded.forward(layer, *random_routing(SPEC, 1, g))
    first = offloaded.stats.last_step
    assert first.hits == 0 and first.misses == 3 * LAYERS and first.steps == 1
    offloaded.end_step()
    d = offloaded.stats.to_dict()
    assert set(d) >= {
        "hits",
        "misses",
        "hit_rate",
        "bytes_copied",
        "copy_time_s",
        "exposed_copy_time_s",
        "steps",
        "last_step",
    }
    assert d["steps"] == 2 and d["hits"] + d["misses"] == 6 * LAYERS
    assert d["last_step"]["hits"] + d["last_step"]["misses"] == 3 * LAYERS
    report = offloaded.report()
    assert report["misses"] == d["misses"] and report["policy"] == "lru" and report["slots"] == 6
    assert (
        report["total_experts"] == 18 and report["resident"] == 6 and report["evictions"] == offloaded.policy.evictions
    )
    json.dumps(report)  # printable as is


def test_reloading_a_cached_expert_updates_its_slot():
    _, offloaded = _stores(6)
    g = torch.Generator().manual_seed(3)
    x, ids, weights = random_routing(SPEC, 1, g)
    offloaded.forward(0, x, ids, weights)
    e = int(ids[0, 0])
    s = int(offloaded.policy.slot_of[0, e])
    gate, up, down = (torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8))
    offloaded.load_expert(0, e, gate, up, down)
    assert torch.equal(offloaded.slots.w13[s][:8], gate) and torch.equal(offloaded.slots.w2[s], down)


def test_mismatched_parts_are_refused():
    banks = HostBanks.for_model(SPEC, "float32", progress=False)
    with pytest.raises(ValueError, match="slot pool has 7 slots but the policy manages 6"):
        OffloadedExperts(slot_pool(SPEC, 7), banks, LRUExpertPolicy(LAYERS, 6, 6), "cpu")
    with pytest.raises(ValueError, match="differs from the host banks"):
        OffloadedExperts(slot_pool(SPEC, 6, dtype="bfloat16"), banks, LRUExpertPolicy(LAYERS, 6, 6), "cpu")


INTERPRETED_CHECKS = [
    "store",
    "device-driven-float32",
    "device-driven-bfloat16",
    "device-driven-biased",
    "device-driven-mixed",
    "prefetch-router-bias",
    "host-share",
    "host-decode-kernel",
    "host-decode",
    "host-decode-poll",
    "host-decode-from-3-tokens",
    "host-decode-covering-none",
    "lent-slots",
    "windowed-chunks",
    "streamed-launches",
    "long-step-rows",
]


def test_every_check_of_the_interpreted_script_runs():
    """The script's CHECKS (read from its source: importing it needs the interpreter) are the ones below."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(__file__).with_name("interpreted_offload_store.py").read_text())
    checks = next(
        n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "CHECKS"
    )
    assert [k.value for k in checks.keys] == INTERPRETED_CHECKS


@pytest.mark.slow
@pytest.mark.parametrize("check", INTERPRETED_CHECKS)
def test_the_triton_path_with_host_alignment_under_the_interpreter(check, monkeypatch):
    """What CUDA runs (Triton over host-aligned groups), on CPU through TRITON_INTERPRET=1: every check in the one
    interpreted child (tests/unit/interpreted_triton.py) of this process's FERRY_TRITON_ON_CPU=1, started once."""
    from tests.unit.interpreted_triton import run_interpreted

    monkeypatch.setenv("FERRY_TRITON_ON_CPU", "1")
    run_interpreted("tests.unit.offload.interpreted_offload_store", "run_check", [((check,), {})])
