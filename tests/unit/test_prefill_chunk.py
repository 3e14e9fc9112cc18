"""The prefill chunk chosen from memory (plan/prefill_chunk.py): the one streaming the fewest expert
bytes per prompt token of the candidates, found without pricing candidates that cannot win."""

import dataclasses
import json
import re

import pytest

from ferry.plan.costs import resident_weight_bytes_from_shapes, workspace_bytes_estimate
from ferry.plan.model_config import parse_model_config
from ferry.plan.planner import Measured, PlanRequest, resolve
from ferry.plan.prefill_chunk import CHUNK_CANDIDATES, plan_with_prefill_chunk
from ferry.plan.store_plan import plan_for_expert_store
from ferry.shared.errors import PlanError
from ferry.shared.units import GiB
from tests.helpers import QWEN3_6_35B

# the model's own context: a 16,384-token chunk is a candidate and prefill alone is priced
# (memory_defaults.long_prompts_expected); the tests fix the snapshots, which an offloading plan otherwise halves
LONG = 262144
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _spec(layers=None, quantization=None):
    """Qwen3.6-35B-A3B as published, cut to its first `layers` text layers (as make-bench-model does)."""
    raw = json.loads((QWEN3_6_35B / "config.json").read_text())
    text = raw["text_config"]
    if layers is not None:
        raw["text_config"] = text | {"num_hidden_layers": layers, "layer_types": text["layer_types"][:layers]}
    if quantization is not None:
        raw["quantization_config"] = quantization
    return parse_model_config(raw)


class Estimates:
    """`measure` for the chooser: shapes and the workspace estimate, with the chunks it was asked for."""

    def __init__(self, spec, req):
        self.spec, self.r, self.asked = spec, resolve(spec, req), []

    def __call__(self, step):
        weights = resident_weight_bytes_from_shapes(self.spec, self.r.dtype)
        if step is None:  # the facts without a workspace
            return Measured(weights, 0)
        self.asked.append(step.max_prefill_tokens)
        return Measured(
            weights,
            workspace_bytes_estimate(
                self.spec, step.dtype, step.max_prefill_tokens, step.max_running_requests, step.max_model_len
            ),
        )

    def at(self, tokens):
        return self(dataclasses.replace(self.r, max_prefill_tokens=tokens))


def _streamed(spec, plan):
    return (spec.total_experts - plan.experts.slots) / plan.max_prefill_tokens


def _every_candidate(spec, req, measure):
    """Each candidate's plan by brute force (None where it does not fit)."""
    plans = {}
    for tokens in CHUNK_CANDIDATES:
        try:
            plans[tokens] = plan_for_expert_store(
                spec, PlanRequest(**{**req.__dict__, "max_prefill_tokens": tokens}), measure.at(tokens)
            )
        except PlanError:
            plans[tokens] = None
    return plans


@pytest.mark.parametrize("gib", [9, 10, 11, 12, 13, 16, 40])
def test_the_chosen_chunk_streams_the_fewest_expert_bytes_a_token(gib):
    """Against every candidate planned by brute force: the chosen plan is one of them, the one whose
    prefill streams the fewest experts a prompt token (the longest on a tie; at most 8,192 tokens where
    every expert is resident), and it is exact."""
    spec = _spec(layers=8, quantization=FP8)
    req = PlanRequest(
        gpu_memory=gib * GiB,
        max_running_requests=8,
        max_model_len=LONG,
        host_memory=100 * GiB,
        linear_state_snapshots=16,
    )
    chosen = plan_with_prefill_chunk(spec, req, Estimates(spec, req))
    plans = {t: p for t, p in _every_candidate(spec, req, Estimates(spec, req)).items() if p is not None}
    resident = [p for t, p in plans.items() if p.experts.slots >= spec.total_experts and t <= 8192]
    if resident:  # nothing streams: the longest chunk up to 8,192 tokens (a longer one only holds decode rows)
        best = max(resident, key=lambda p: p.max_prefill_tokens)
    else:
        best = min(plans.values(), key=lambda p: (_streamed(spec, p), -p.max_prefill_tokens))
    assert chosen.max_prefill_tokens == best.max_prefill_tokens
    assert chosen.experts.slots == best.experts.slots and chosen.total_bytes == best.total_bytes
    assert chosen.max_prefill_tokens_source.startswith("chosen from memory")


def test_fp8_hybrid_cut_at_12gib_takes_a_shorter_chunk_for_its_experts():
    """The workload of issue 21's FP8 cut with Ferry's own plan: at 8192 tokens the workspace costs
    ~800 expert slots; at 2048 nearly every expert has one."""
    spec = _spec(layers=8, quantization=FP8)
    req = PlanRequest(
        gpu_memory=12 * GiB,
        memory_ratio=0.9,
        max_running_requests=8,
        max_model_len=LONG,
        host_memory=100 * GiB,
        linear_state_snapshots=16,
    )
    plan = plan_with_prefill_chunk(spec, req, Estimates(spec, req))
    longest = plan_for_expert_store(
        spec, PlanRequest(**{**req.__dict__, "max_prefill_tokens": 8192}), Estimates(spec, req).at(8192)
    )
    assert plan.max_prefill_tokens == 2048
    assert plan.experts.slots > longest.experts.slots + 600
    assert plan.workspace_bytes < longest.workspace_bytes


def test_every_expert_resident_keeps_the_longest_chunk_and_prices_only_it():
    spec = _spec(layers=8, quantization=FP8)
    req = PlanRequest(
        gpu_memory=40 * GiB,
        max_running_requests=8,
        max_model_len=LONG,
        host_memory=100 * GiB,
        linear_state_snapshots=16,
    )
    measure = Estimates(spec, req)
    plan = plan_with_prefill_chunk(spec, req, measure)
    assert (plan.max_prefill_tokens, plan.experts.slots) == (8192, spec.total_experts)
    assert measure.asked == [8192]
    assert plan.max_prefill_tokens_source == "chosen from memory: every expert resident"


@pytest.mark.parametrize("max_model_len", [8192, 262144])
def test_mostly_offloaded_takes_the_longest_chunk_where_long_prompts_are_expected(max_model_len):
    """Full-size 35B at 24 GiB: four fifths of the experts live on the host whatever the chunk, so
    the longest streams them the fewest times (32,768 tokens: a quarter of the bytes a long prompt streams at
    8,192, for a few per cent of the slots), and the shorter ones are never priced (three profiles at boot)."""
    spec = _spec()
    req = PlanRequest(
        gpu_memory=24 * GiB,
        max_running_requests=8,
        max_model_len=max_model_len,
        host_memory=400 * GiB,
        linear_state_snapshots=16,
    )
    measure = Estimates(spec, req)
    plan = plan_with_prefill_chunk(spec, req, measure)
    if max_model_len <= 16384:  # no prompt is longer than 16,384 tokens: that chunk's workspace would buy nothing
        assert plan.max_prefill_tokens == 8192 and measure.asked == [8192]
        return
    assert plan.max_prefill_tokens == 32768 and plan.experts.slots < spec.total_experts
    assert measure.asked == [8192, 16384, 32768]
    at_8192 = plan_for_expert_store(spec, PlanRequest(**{**req.__dict__, "max_prefill_tokens": 8192}), measure.at(8192))
    assert 0 < at_8192.experts.slots - plan.experts.slots < 0.06 * spec.total_experts


def test_a_chunk_longer_than_one_that_did_not_fit_is_never_profiled():
    """A boot profiles each chunk it prices by running its step: where 8,192 tokens' workspace does
    not fit, 16,384's cannot, and profiling it would only take memory and time."""
    spec = _spec(layers=8, quantization=FP8)
    base = dict(max_running_requests=8, max_model_len=LONG, host_memory=100 * GiB, linear_state_snapshots=16)
    for mib in range(5000, 9000, 100):
        req = PlanRequest(gpu_memory=mib * 2**20, **base)
        plans = _every_candidate(spec, req, Estimates(spec, req))
        if plans[8192] is None and plans[4096] is not None:
            break
    else:
        raise AssertionError("no budget between the two chunks' needs: the test's range is wrong")
    measure = Estimates(spec, req)
    assert plan_with_prefill_chunk(spec, req, measure).max_prefill_tokens == 4096
    assert measure.asked == [8192, 4096]


def test_the_flag_fixes_the_chunk():
    spec = _spec(layers=8, quantization=FP8)
    req = PlanRequest(
        gpu_memory=12 * GiB,
        max_running_requests=8,
        max_model_len=LONG,
        host_memory=100 * GiB,
        linear_state_snapshots=16,
        max_prefill_tokens=8192,
    )
    measure = Estimates(spec, req)
    plan = plan_with_prefill_chunk(spec, req, measure)
    assert (plan.max_prefill_tokens, plan.max_prefill_tokens_source, measure.asked) == (
        8192,
        "--max-prefill-tokens",
        [8192],
    )


def test_a_budget_too_small_for_the_longest_chunk_boots_with_a_shorter_one():
    """Before, a budget whose 8192-token workspace did not fit beside the floors failed the plan."""
    spec = _spec(layers=8, quantization=FP8)
    base = dict(max_running_requests=8, max_model_len=LONG, host_memory=100 * GiB, linear_state_snapshots=16)
    fits = None
    for mib in range(5000, 9000, 100):
        req = PlanRequest(gpu_memory=mib * 2**20, **base)
        plans = _every_candidate(spec, req, Estimates(spec, req))
        if plans[8192] is None and plans[2048] is not None:
            fits = req
            break
    assert fits is not None, "no budget between the two chunks' needs: the test's range is wrong"
    assert plan_with_prefill_chunk(spec, fits, Estimates(spec, fits)).max_prefill_tokens < 8192


def test_nothing_fits_says_the_chunk_is_not_what_to_change():
    spec = _spec(layers=8, quantization=FP8)
    req = PlanRequest(
        gpu_memory=3 * GiB, max_running_requests=8, max_model_len=LONG, host_memory=100 * GiB, linear_state_snapshots=16
    )
    with pytest.raises(PlanError, match="nor of 1024, 512, 256: the chunk is not what to change"):
        plan_with_prefill_chunk(spec, req, Estimates(spec, req))


def test_where_only_a_shorter_chunk_fits_the_failure_names_it_and_it_fits():
    """A budget where no candidate chunk fits but a shorter one does: the message names the longest that does,
    and a plan with it fits."""
    spec = _spec(layers=8, quantization=FP8)
    base = dict(max_running_requests=8, max_model_len=LONG, host_memory=100 * GiB, linear_state_snapshots=16)
    named = None
    for mib in range(3000, 9000, 25):
        req = PlanRequest(gpu_memory=mib * 2**20, **base)
        try:
            plan_with_prefill_chunk(spec, req, Estimates(spec, req))
            break  # the candidates fit from here on
        except PlanError as e:
            found = re.search(r"--max-prefill-tokens (\d+) fits", str(e))
            if found:
                named = req, int(found[1])
    assert named is not None, "no budget where only a shorter chunk fits: the test's range is wrong"
    req, tokens = named
    chunk_req = dataclasses.replace(req, max_prefill_tokens=tokens)
    plan = plan_with_prefill_chunk(spec, chunk_req, Estimates(spec, chunk_req))
    assert plan.max_prefill_tokens == tokens and plan.total_bytes <= plan.budget_bytes


def test_no_chunk_past_the_longest_step_the_contexts_allow():
    """One request of 2,048 tokens never makes a 16,384-token step: that chunk's workspace would only take
    slots (decode misses) from the full-size 35B at 24 GiB. 8,192 stays where it was chosen before."""
    spec = _spec()
    req = PlanRequest(
        gpu_memory=24 * GiB, max_running_requests=1, max_model_len=2048, host_memory=400 * GiB, linear_state_snapshots=2
    )
    measure = Estimates(spec, req)
    assert plan_with_prefill_chunk(spec, req, measure).max_prefill_tokens == 8192
    assert 16384 not in measure.asked


def test_a_caller_can_cap_the_candidates():
    """Expert-parallel ranks stream nothing past their caches and pass longest=8192: the chunk the full-size
    35B at 24 GiB would take alone (16,384) is never tried."""
    spec = _spec()
    req = PlanRequest(
        gpu_memory=24 * GiB,
        max_running_requests=8,
        max_model_len=262144,
        host_memory=400 * GiB,
        linear_state_snapshots=16,
    )
    measure = Estimates(spec, req)
    assert plan_with_prefill_chunk(spec, req, measure, longest=8192).max_prefill_tokens == 8192
    assert measure.asked == [8192]
