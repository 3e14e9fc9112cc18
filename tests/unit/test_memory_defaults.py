"""Defaults a single user's card gets (plan/memory_defaults.py, plan/outside_memory.py): the whole --gpu-memory less
what lives outside the allocator, running requests and context sized from memory where experts are offloaded,
the 16,384-token chunk only where long prompts are asked for, and a plan that does not fit naming its flags."""

import json

import pytest

from ferry.plan.costs import resident_weight_bytes_from_shapes, workspace_bytes_estimate
from ferry.plan.memory_defaults import KV_FLOOR_SHARE, MIN_CONTEXT, OFFLOADED_MAX_RUNNING_REQUESTS
from ferry.plan.model_config import load_model_config, parse_model_config
from ferry.plan.outside_memory import OutsideMemory, estimated_outside
from ferry.plan.planner import DEFAULT_MAX_RUNNING_REQUESTS, Measured, PlanRequest, make_plan, resolve
from ferry.plan.prefill_chunk import plan_with_prefill_chunk
from ferry.shared.errors import PlanError
from ferry.shared.units import GiB, MiB, format_bytes
from tests.helpers import QWEN3_6_35B, QWEN3_30B, REAL_MODELS

HOST = 512 * GiB


def _estimates(spec, gpu_memory_given=True):
    """`measure` as `ferry plan` gives it: shapes, the workspace estimate, the outside estimate."""
    outside = estimated_outside(budget_from_free_memory=not gpu_memory_given)

    def measure(step):
        weights = resident_weight_bytes_from_shapes(spec, spec.dtype)
        if step is None:
            return Measured(weights, 0, outside=outside)
        workspace = workspace_bytes_estimate(
            spec, step.dtype, step.max_prefill_tokens, step.max_running_requests, step.max_model_len
        )
        return Measured(weights, workspace, outside=outside)

    return measure


def _plan(model, **flags):
    spec = load_model_config(model)
    req = PlanRequest(host_memory=HOST, **flags)
    return spec, plan_with_prefill_chunk(spec, req, _estimates(spec))


def test_bf16_35b_at_24gib_gets_a_single_users_defaults_and_many_more_slots():
    """The issue's case: 64 running requests and 262,144 tokens of context left the bf16 35B 393 of 10,240 slots."""
    spec, plan = _plan(QWEN3_6_35B, gpu_memory=24 * GiB)
    assert plan.max_running_requests == OFFLOADED_MAX_RUNNING_REQUESTS
    assert MIN_CONTEXT <= plan.max_model_len < spec.max_position_embeddings
    assert plan.kv.bytes <= plan.budget_bytes // KV_FLOOR_SHARE + 2 * MiB
    assert plan.max_prefill_tokens <= 8192  # no long prompt was asked for
    assert plan.experts.slots > 4 * 393
    assert "chosen from memory" in plan.sizing_source and "--max-model-len" in plan.sizing_source
    # the old defaults, given as flags, are what they were: the same plan as before, a few hundred slots
    _, old = _plan(QWEN3_6_35B, gpu_memory=24 * GiB, max_running_requests=64, max_model_len=262144)
    assert old.experts.slots * 2 < plan.experts.slots


def test_a_card_holding_every_expert_keeps_a_servers_defaults():
    spec, plan = _plan(QWEN3_30B, gpu_memory=80 * GiB)
    assert plan.experts.slots == spec.total_experts
    assert (plan.max_running_requests, plan.max_model_len) == (
        DEFAULT_MAX_RUNNING_REQUESTS,
        spec.max_position_embeddings,
    )
    assert "server's defaults" in plan.sizing_source


def test_a_kv_requirement_keeps_the_models_context_and_the_long_chunk():
    """The 262k scenario: --num-tokens 262144 asks for long prompts, so the context stays the model's and the
    32,768-token chunk (a quarter of the expert passes of a long prompt at 8,192) is priced."""
    spec, plan = _plan(QWEN3_6_35B, gpu_memory=24 * GiB, num_tokens=262144)
    assert plan.max_model_len == spec.max_position_embeddings and plan.kv.tokens == 262144
    assert plan.max_prefill_tokens == 32768


def test_flags_given_are_kept():
    _, plan = _plan(QWEN3_6_35B, gpu_memory=24 * GiB, max_running_requests=3, max_model_len=20000)
    assert (plan.max_running_requests, plan.max_model_len) == (3, 20000)
    assert plan.sizing_source == "--max-running-requests and --max-model-len"


def test_122b_fits_a_24gib_card_by_default_and_16gib_by_shrinking_the_defaults():
    """Before, `ferry plan` for Qwen3.5-122B-A10B at 24 GiB only named --gpu-memory."""
    model = REAL_MODELS / "qwen3.5-122b-a10b-nvfp4"
    _, at24 = _plan(model, gpu_memory=24 * GiB)
    assert at24.max_running_requests == OFFLOADED_MAX_RUNNING_REQUESTS
    _, at16 = _plan(model, gpu_memory=16 * GiB)
    assert at16.max_running_requests < OFFLOADED_MAX_RUNNING_REQUESTS and at16.max_model_len < at24.max_model_len
    assert at16.total_bytes <= at16.budget_bytes


def test_a_plan_that_does_not_fit_names_the_flags_that_would_together():
    model = REAL_MODELS / "qwen3.5-122b-a10b-nvfp4"
    with pytest.raises(PlanError) as err:
        _plan(model, gpu_memory=16 * GiB, max_running_requests=8, max_model_len=65536)
    text = str(err.value)
    assert "--gpu-memory would have to be at least" in text
    line = next(ln for ln in text.splitlines() if "these fit together" in ln)
    n, m = (
        int(line.split("--max-running-requests ")[1].split()[0]),
        int(line.split("--max-model-len ")[1].split(":")[0]),
    )
    _, fits = _plan(model, gpu_memory=16 * GiB, max_running_requests=n, max_model_len=m, max_prefill_tokens=2048)
    assert fits.total_bytes <= fits.budget_bytes


def test_gpu_memory_is_the_whole_process_context_included():
    """--gpu-memory 24GiB means nvidia-smi's figure: the plan's budget leaves the context, the kernels loaded later
    and the allocator's headroom out of it, and says so."""
    spec = load_model_config(QWEN3_30B)
    outside = OutsideMemory(held=600 * MiB, late=128 * MiB, source="NVML")
    measured = Measured(3 * GiB, 1 * GiB, free_bytes=79 * GiB, outside=outside)
    plan = make_plan(spec, PlanRequest(gpu_memory=24 * GiB, host_memory=HOST, max_model_len=4096), measured)
    assert plan.budget_bytes == 24 * GiB - 728 * MiB - 256 * MiB
    assert (
        "728.00 MiB outside the allocator" in plan.budget_derivation and "allocator headroom" in plan.budget_derivation
    )
    # an explicit ratio is its own headroom
    ratio = make_plan(
        spec, PlanRequest(gpu_memory=24 * GiB, memory_ratio=0.95, host_memory=HOST, max_model_len=4096), measured
    )
    assert ratio.budget_bytes == int(24 * GiB * 0.95) - 728 * MiB


def test_gpu_memory_past_what_the_card_has_names_the_largest_value():
    spec = load_model_config(QWEN3_30B)
    measured = Measured(3 * GiB, 1 * GiB, free_bytes=23 * GiB, outside=OutsideMemory(600 * MiB, 128 * MiB, "NVML"))
    with pytest.raises(PlanError, match=str(23 * GiB + 600 * MiB)):
        make_plan(spec, PlanRequest(gpu_memory=24 * GiB, host_memory=HOST), measured)
    # what the context already holds is not free memory the plan must find: 23 GiB free + 600 MiB held is enough
    make_plan(spec, PlanRequest(gpu_memory=23 * GiB + 600 * MiB, host_memory=HOST, max_model_len=4096), measured)


def test_cpu_budgets_have_nothing_outside_them():
    spec = load_model_config(QWEN3_30B)
    plan = make_plan(
        spec, PlanRequest(gpu_memory=24 * GiB, host_memory=HOST, max_model_len=4096), Measured(3 * GiB, GiB)
    )
    assert plan.budget_bytes == 24 * GiB and plan.budget_derivation.endswith("= 24.00 GiB")


def test_ferry_plan_json_carries_the_sizing(tmp_path):
    spec, plan = _plan(QWEN3_6_35B, gpu_memory=24 * GiB)
    assert json.loads(json.dumps(plan.to_dict()))["sizing_source"] == plan.sizing_source
    assert resolve(spec, PlanRequest()).max_running_requests == DEFAULT_MAX_RUNNING_REQUESTS


def test_without_long_prompts_the_chunk_weighs_a_chat_turns_decode_misses():
    """The full-size 35B NVFP4 at 24 GiB with the issue's flags: an 8,192-token chunk streamed the fewest experts a
    prompt token, but its workspace cost hundreds of slots that every decode token misses; for a chat turn (32 prompt
    tokens an output token) the shortest chunk crosses PCIe least, and the chooser takes the brute force's best."""
    from ferry.plan.prefill_chunk import PROMPT_TOKENS_PER_OUTPUT_TOKEN
    from ferry.plan.store_plan import plan_for_expert_store

    raw = json.loads((QWEN3_6_35B / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head", "model.embed_tokens"],
    }
    spec = parse_model_config(raw)
    flags = dict(
        gpu_memory=24 * GiB, max_running_requests=8, max_model_len=8192, host_memory=HOST, linear_state_snapshots=8
    )
    chosen = plan_with_prefill_chunk(spec, PlanRequest(**flags), _estimates(spec))
    k_layers = spec.num_experts_per_tok * len(spec.moe_layer_indices)

    def chat_cost(plan):
        unslotted = spec.total_experts - plan.experts.slots
        return (
            unslotted / plan.max_prefill_tokens
            + k_layers * unslotted / spec.total_experts / PROMPT_TOKENS_PER_OUTPUT_TOKEN
        )

    plans = {}
    for tokens in (8192, 4096, 2048):
        req = PlanRequest(**flags, max_prefill_tokens=tokens)
        plans[tokens] = plan_for_expert_store(spec, req, _estimates(spec)(resolve(spec, req)))
    best = min(plans.values(), key=chat_cost)
    assert chosen.max_prefill_tokens == best.max_prefill_tokens < 8192
    assert chosen.experts.slots == best.experts.slots > plans[8192].experts.slots
    assert "chat turn" in chosen.max_prefill_tokens_source


def test_an_offloading_plan_keeps_one_snapshot_a_running_request():
    """Both sizing flags given, snapshots not: where experts are offloaded each running request keeps one snapshot
    (its conversation's deepest point), the second's 61 MiB going to slots; with every expert resident, two."""
    _, offloaded = _plan(QWEN3_6_35B, gpu_memory=24 * GiB, max_running_requests=8, max_model_len=8192)
    assert (
        offloaded.linear_state_snapshots.snapshots == 8
        and "1 x max_running_requests" in offloaded.linear_state_snapshots.source
    )
    _, given = _plan(
        QWEN3_6_35B, gpu_memory=24 * GiB, max_running_requests=8, max_model_len=8192, linear_state_snapshots=16
    )
    assert given.linear_state_snapshots.snapshots == 16 and given.experts.slots < offloaded.experts.slots
    spec, resident = _plan(QWEN3_6_35B, gpu_memory=80 * GiB, max_running_requests=8, max_model_len=8192)
    assert resident.experts.slots == spec.total_experts and resident.linear_state_snapshots.snapshots == 16


def test_a_plan_that_mtp_does_not_fit_names_the_method_and_what_it_frees(capsys):
    """GLM-4.5-Air at 24 GiB fits without its NextN layer, not with it (4.42 GiB of bf16 weights, its experts
    resident): the failure says so, with the bytes another method frees, which are what the two plans differ by."""
    import argparse

    from ferry.plan import plan_command
    from ferry.plan.mtp_layer import drafting_spec, mtp_resident_bytes

    model = REAL_MODELS / "glm-4.5-air"

    def plan(*extra):
        parser = argparse.ArgumentParser()
        plan_command.add_arguments(parser)
        args = parser.parse_args([str(model), "--gpu-memory", "24GiB", "--host-memory", "512GiB", "--json", *extra])
        capsys.readouterr()
        return plan_command.run(args), capsys.readouterr()

    rc, fits = plan()
    assert rc == 0
    with pytest.raises(PlanError) as failed:
        plan("--speculative-method", "mtp")
    (line,) = [ln for ln in str(failed.value).splitlines() if "--speculative-method ngram (or off)" in ln]
    spec = load_model_config(model)
    weights = mtp_resident_bytes(drafting_spec(spec), "bfloat16")
    assert f"frees the MTP layer's {weights / GiB:.2f} GiB of weights" in line and line.endswith("the plan then fits")
    assert json.loads(fits.out.strip().splitlines()[-1])["total_bytes"] <= 24 * GiB


def test_a_kv_bound_plan_names_fp8_kv_with_the_pool_it_would_make():
    """Qwen3-30B-A3B at 16 GiB with 200,000 tokens of KV: too much in bf16, and the failure says fp8 K/V makes the
    pool the size the fp8 plan then has, which fits."""
    with pytest.raises(PlanError) as err:
        _plan(QWEN3_30B, gpu_memory=16 * GiB, num_tokens=200_000)
    (line,) = [ln for ln in str(err.value).splitlines() if "--kv-cache-dtype fp8" in ln]
    _, fp8 = _plan(QWEN3_30B, gpu_memory=16 * GiB, num_tokens=200_000, kv_cache_dtype="fp8")
    assert line.strip().endswith(f"becomes {format_bytes(fp8.kv.bytes)}; the plan then fits"), line
    assert fp8.total_bytes <= fp8.budget_bytes
