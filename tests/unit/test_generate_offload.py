"""`ferry generate` with experts offloaded (fewer GPU slots than experts) against every expert
resident: the same greedy tokens and logprobs, bit for bit in float32, for both architectures and
cache sizes down to the planner's minimum; and the --json expert_cache figures add up."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_ARCHS
from tests.unit.test_generate_e2e import ferry_generate

# 70 prompt tokens in one step: above the offload store's prefill threshold (64 tokens), so its
# misses are copied in several chunks (the prefill pipeline); then single-token decode steps.
PROMPT_IDS = ",".join(str((i * 37 + 11) % 200) for i in range(70))
ARGS = (
    "--prompt-ids",
    PROMPT_IDS,
    "--max-tokens",
    "8",
    "--ignore-eos",
    "--dtype",
    "float32",
    "--max-prefill-tokens",
    "80",
)


def _expert_bytes(plan: dict) -> int:
    return plan["experts"]["bytes_per_slot"]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_offloaded_generation_equals_all_resident(arch, tiny_models, capsys):
    model = tiny_models[arch]
    resident = ferry_generate(capsys, model, *ARGS)
    experts = resident["plan"]["experts"]
    assert experts["slots"] == experts["total"]
    cache = resident["expert_cache"]
    assert cache["policy"] == "all-resident" and cache["misses"] == cache["bytes_copied"] == 0
    assert cache["hits"] > 0 and cache["hit_rate"] == 1.0 and len(cache["per_step"]) == 8
    for slots in sorted({experts["min_slots"], (experts["min_slots"] + experts["total"]) // 2, experts["total"] - 1}):
        for policy in ("lfu", "lru") if slots == experts["min_slots"] else ("lfu",):
            got = ferry_generate(capsys, model, *ARGS, "--moe-cache-size", str(slots), "--expert-policy", policy)
            assert got["token_ids"] == resident["token_ids"], (slots, policy)
            assert got["logprobs"] == resident["logprobs"], (slots, policy)
            cache = got["expert_cache"]
            assert cache["policy"] == policy and cache["slots"] == slots < cache["total_experts"]
            assert cache["misses"] > 0, f"{slots} slots for {experts['total']} experts must miss"
            assert cache["bytes_copied"] == cache["misses"] * _expert_bytes(got["plan"])
            assert cache["hits"] + cache["misses"] == resident["expert_cache"]["hits"]  # the same routing
            assert sum(s["misses"] for s in cache["per_step"]) == cache["misses"]
            assert cache["hit_rate"] == pytest.approx(cache["hits"] / (cache["hits"] + cache["misses"]))


def test_expert_bytes_follow_the_config(tiny_models, capsys):
    import json

    config = json.loads((tiny_models["qwen3_moe"] / "config.json").read_text())
    got = ferry_generate(capsys, tiny_models["qwen3_moe"], *ARGS, "--moe-cache-size", "8")
    assert _expert_bytes(got["plan"]) == 3 * config["hidden_size"] * config["moe_intermediate_size"] * 4  # fp32


def test_dummy_weights_fill_the_host_banks(tiny_models, capsys):
    got = ferry_generate(capsys, tiny_models["qwen3_5_moe"], *ARGS, "--load-format", "dummy", "--moe-cache-size", "8")
    assert len(got["token_ids"]) == 8 and all(lp <= 0 for lp in got["logprobs"])
    assert got["expert_cache"]["misses"] > 0


def test_a_ring_chunk_past_the_plans_staging_slots_is_refused_naming_the_flag(tiny_models, capsys):
    """--prefill-ring-chunk / --long-prefill-ring-chunk are checked against the plan's prefill staging slots at
    boot, before any bank is pinned: exit 2 and the flag named, as for any other bad flag."""
    from ferry.services.cli import main

    model = tiny_models[TINY_ARCHS[0]]
    base = [
        "generate",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--gpu-memory",
        "64MiB",
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "1",
        "--moe-cache-size",
        "8",
    ]
    for flag, value, said in (
        ("--prefill-ring-chunk", "1000", "a ring chunk must fit the plan's"),
        ("--long-prefill-ring-chunk", "0", "must be at least 1 expert"),
    ):
        assert main([*base, flag, value]) == 2
        err = capsys.readouterr().err
        assert flag in err and said in err, err
    assert main([*base, "--prefill-ring-chunk", "2", "--long-prefill-ring-chunk", "4"]) == 0
