"""The MoE block's fused parameters and its fused (Triton-path) forward.

* Loading: the router and the shared expert's gate are one [E + 1, hidden] parameter, gate_proj and
  up_proj one [2I, hidden]; a saved tiny checkpoint's separate tensors land in their row views,
  nothing is held twice (the planner measures resident weights from the allocator), the router's
  `weight` stays the [E, hidden] view the offload store's prediction applies, and a missing,
  repeated or misshapen part is named.
* Forward: the block through the Triton path's kernels (interpreted, in a child process:
  interpreted_moe_block.py) against its plain-torch reference, with and without padding rows; and its
  routed rows left unsummed for the next norm, against summing them first."""

from __future__ import annotations

import os

import pytest
import torch
from interpreted_triton import run_interpreted
from model_harness import make_pools
from safetensors.torch import load_file
from tiny_models import tiny_model

from ferry.plan.costs import resident_weight_shapes
from ferry.services.worker.models import WeightLoadError, build_model
from ferry.services.worker.offload.stores.resident import ResidentExperts

ARCHS = ["qwen3_moe", "qwen3_next", "qwen3_5_moe"]


def _saved(arch, tmp_path, **overrides):
    hf, spec = tiny_model(arch, seed=41, **overrides)
    hf.save_pretrained(tmp_path)
    on_disk = load_file(os.path.join(tmp_path, "model.safetensors"))
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    model = build_model(
        spec, torch.float32, "cpu", ResidentExperts(pools.experts, len(spec.moe_layer_indices), spec.num_experts)
    )
    return spec, model, on_disk


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_tensors_load_into_row_views_of_the_fused_parameters(arch, tmp_path):
    dense = [1] if arch != "qwen3_5_moe" else []  # a dense MLP layer fuses its gate/up too
    spec, model, on_disk = _saved(arch, tmp_path, mlp_only_layers=dense)
    model.load_weights(on_disk.items())
    e = spec.num_experts
    params = dict(model.named_parameters())
    assert not any(n.endswith((".shared_expert_gate.weight", ".gate_proj.weight", ".up_proj.weight")) for n in params)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}.mlp."
        mlp = layer.mlp
        if spec.moe_layers[i]:
            fused = mlp.gate.logit_weight
            assert fused.shape == (e + (1 if spec.shared_expert_intermediate_size else 0), spec.hidden_size)
            assert torch.equal(fused[:e], on_disk[p + "gate.weight"])
            # what boot hands the offload store for next-layer prediction: the [E, hidden] router, a view
            assert mlp.gate.weight.shape == (e, spec.hidden_size) and mlp.gate.weight.data_ptr() == fused.data_ptr()
            if spec.shared_expert_intermediate_size:
                assert torch.equal(fused[e:], on_disk[p + "shared_expert_gate.weight"])
                assert torch.equal(mlp.gate.shared_gate_weight, on_disk[p + "shared_expert_gate.weight"])
                mlp, p = mlp.shared_expert, p + "shared_expert."
            else:
                continue
        i_size = mlp.intermediate
        assert torch.equal(mlp.gate_up_proj.weight[:i_size], on_disk[p + "gate_proj.weight"])
        assert torch.equal(mlp.gate_up_proj.weight[i_size:], on_disk[p + "up_proj.weight"])
        assert torch.equal(mlp.down_proj.weight, on_disk[p + "down_proj.weight"])


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_parameters_hold_each_weight_once(arch, tmp_path):
    """The allocator's bytes (what boot measures: distinct storages) are the checkpoint's resident
    tensors' bytes (what plan/costs.py estimates from their shapes): no tensor is duplicated."""
    spec, model, _ = _saved(arch, tmp_path)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    resident = sum(torch.Size(s).numel() * 4 for s in resident_weight_shapes(spec).values())  # a float32 model
    assert sum(storages.values()) == resident


def test_a_missing_shared_gate_is_named(tmp_path):
    _, model, on_disk = _saved("qwen3_next", tmp_path)
    del on_disk["model.layers.1.mlp.shared_expert_gate.weight"]
    with pytest.raises(WeightLoadError, match=r"layers\.1\.mlp\.shared_expert_gate\.weight"):
        model.load_weights(on_disk.items())


def test_a_missing_up_proj_is_named(tmp_path):
    _, model, on_disk = _saved("qwen3_5_moe", tmp_path)
    del on_disk["model.layers.2.mlp.shared_expert.up_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"layers\.2\.mlp\.shared_expert\.up_proj\.weight"):
        model.load_weights(on_disk.items())


def test_a_misshapen_part_is_named(tmp_path):
    _, model, on_disk = _saved("qwen3_next", tmp_path)
    on_disk["model.layers.0.mlp.gate.weight"] = torch.zeros(5, 32)
    want = r"'model\.layers\.0\.mlp\.gate\.weight' has shape \(5, 32\), expected \(4, 32\)"
    with pytest.raises(WeightLoadError, match=want):
        model.load_weights(on_disk.items())


def test_a_part_given_twice_is_refused(tmp_path):
    _, model, on_disk = _saved("qwen3_5_moe", tmp_path)
    items = [
        *on_disk.items(),
        (
            "model.layers.0.mlp.shared_expert.gate_proj.weight",
            on_disk["model.layers.0.mlp.shared_expert.gate_proj.weight"],
        ),
    ]
    with pytest.raises(WeightLoadError, match="given twice"):
        model.load_weights(items)


def test_the_fused_parameter_name_is_not_a_checkpoint_name(tmp_path):
    spec, model, on_disk = _saved("qwen3_next", tmp_path)
    on_disk["model.layers.0.mlp.gate.logit_weight"] = torch.zeros(spec.num_experts + 1, spec.hidden_size)
    with pytest.raises(WeightLoadError, match=r"unexpected .*gate\.logit_weight"):
        model.load_weights(on_disk.items())


# (arch, config overrides, rows, real rows or None)
BLOCK_CASES = [
    ("qwen3_5_moe", dict(num_experts=8, num_experts_per_tok=4), 1, None),
    ("qwen3_5_moe", dict(num_experts=8, num_experts_per_tok=4), 17, 11),  # padding rows: not marked
    ("qwen3_next", dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=False), 3, None),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=True), 3, 2),  # no shared expert
    # the sigmoid router (float32 logits into the router kernel) and an ungated shared expert
    ("glm4_moe", {}, 3, None),
    ("glm4_moe", dict(num_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2), 17, 11),
]


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory):
    env = {"FERRY_TRITON_ON_CPU": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        calls = [((*case, 7 + i), {}) for i, case in enumerate(BLOCK_CASES)]
        return run_interpreted("tests.unit.interpreted_moe_block", "block_outputs", calls)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.mark.parametrize("index", range(len(BLOCK_CASES)), ids=[f"{c[0]}-T{c[2]}-real{c[3]}" for c in BLOCK_CASES])
def test_fused_block_matches_its_reference(block_runs, index):
    r = block_runs[index]
    ids, weights, shared = r["fused_route"]
    ref_ids, ref_weights, ref_shared = r["reference_route"]
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    if ref_shared is None:
        assert shared is None
    else:
        torch.testing.assert_close(shared, ref_shared, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(r["fused"]).all()
    torch.testing.assert_close(r["fused"], r["reference"], rtol=1e-5, atol=1e-5)
    assert torch.equal(r["marked"], r["want_marks"]), "the marking kernel marks what the scatter marked"


@pytest.mark.parametrize("index", range(len(BLOCK_CASES)), ids=[f"{c[0]}-T{c[2]}-real{c[3]}" for c in BLOCK_CASES])
def test_unsummed_rows_through_the_next_norm_are_the_summed_outputs_bits(block_runs, index):
    """The decoder asks for the routed rows unsummed; the next norm (or the shared expert's combine)
    sums them itself, and the result must be the bits of summing first (kernels/expert_rows_sum.py)."""
    arch, _, rows, _ = BLOCK_CASES[index]
    r = block_runs[index]
    # only a block without a shared expert hands its rows on, and only at the pair kernels' sizes
    want_kind = "ExpertRows" if arch == "qwen3_moe" and rows * 3 <= 64 else "Tensor"
    assert r["unsummed_kind"] == want_kind
    (got, got_residual), (want, want_residual) = r["norm_of_rows"], r["norm_of_sum"]
    assert torch.equal(got_residual, want_residual) and torch.equal(got, want)
