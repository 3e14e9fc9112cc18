"""glm4_moe (GLM-4.5/4.6/4.7 MoE) beyond the parity list (test_model_parity.py): its router against
transformers' own, `ferry plan` on GLM-4.5-Air's published config priced tensor by tensor, the MTP layer
neither loaded nor priced, config.json's routing fields checked, and `ferry generate` with experts offloaded
equal to transformers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from safetensors.torch import load_file
from tiny_models import redrawn_tiny_checkpoint, tiny_model

from ferry.kernels.router_topk_reference import sigmoid_topk_reference
from ferry.plan.costs import ALLOC_GRANULE, is_served, resident_weight_bytes_from_checkpoint
from ferry.plan.model_config import load_model_config, parse_model_config
from ferry.services.worker.checkpoint import resident_tensor, routed_expert_tensor
from ferry.services.worker.models import WeightLoadError
from ferry.shared.errors import ConfigError
from tests.unit.test_generate_e2e import ferry_generate, transformers_greedy

GLM_45_AIR = Path(__file__).resolve().parents[1] / "data/models/glm-4.5-air"


@pytest.mark.parametrize("groups,topk_groups,norm,scaling", [(1, 1, True, 1.0), (4, 2, True, 2.5), (8, 3, False, 1.5)])
def test_the_sigmoid_router_is_transformers_glm4_moe_router(groups, topk_groups, norm, scaling):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(
        hidden_size=16,
        n_routed_experts=32,
        num_experts_per_tok=6,
        n_group=groups,
        topk_group=topk_groups,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
    )
    router = Glm4MoeTopkRouter(config)
    g = torch.Generator().manual_seed(groups)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 16, generator=g))
        router.e_score_correction_bias.copy_(0.5 * torch.randn(32, generator=g))
    x = torch.randn(200, 16, generator=g)
    logits, ref_weights, ref_ids = router(x)
    ids, weights = sigmoid_topk_reference(
        logits, 6, norm, router.e_score_correction_bias, groups, topk_groups, scaling, torch.float32
    )
    order = ref_ids.sort(dim=-1).indices  # transformers' top k are unsorted
    got_order = ids.sort(dim=-1).indices
    assert torch.equal(ids.gather(1, got_order), ref_ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, got_order), ref_weights.gather(1, order), rtol=1e-6, atol=1e-7)


def _granules(*shape: int) -> int:
    """bf16 bytes of one tensor as the planner counts them: rounded up to the allocator's granule."""
    n = 2
    for d in shape:
        n *= d
    return -(-n // ALLOC_GRANULE) * ALLOC_GRANULE


def test_ferry_plan_prices_glm_4_5_air_tensor_by_tensor():
    """GLM-4.5-Air at 24 GiB: the resident weights are its published shapes, worked out here from the
    architecture (not from the planner's tables), the MTP layer 46 left out."""
    hidden, layers, vocab, heads, kv_heads, head_dim = 4096, 46, 151552, 96, 8, 128
    dense, moe, experts, dense_first = 10944, 1408, 128, 1
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = (
        _granules(q, hidden) + _granules(q)  # q_proj with its bias
        + 2 * (_granules(kv, hidden) + _granules(kv))  # k_proj, v_proj with theirs
        + _granules(hidden, q)  # o_proj, no bias; no q/k norms (use_qk_norm false)
    )  # fmt: skip
    norms = 2 * _granules(hidden)
    dense_mlp = 3 * _granules(dense, hidden)
    moe_block = _granules(experts, hidden) + _granules(experts) + 3 * _granules(moe, hidden)  # router, bias, shared
    expected = (
        2 * _granules(vocab, hidden)  # embed_tokens, lm_head (untied)
        + _granules(hidden)  # final norm
        + layers * (attention + norms)
        + dense_first * dense_mlp
        + (layers - dense_first) * moe_block
    )
    out = subprocess.run(
        [sys.executable, "-m", "ferry.services.cli", "plan", "--model", str(GLM_45_AIR), "--gpu-memory", "24GiB"]
        + ["--host-memory", "256GiB", "--json"],  # its banks: 140 GiB
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["weights_bytes"] == expected
    assert plan["experts"]["total"] == (layers - dense_first) * experts  # layer 46's (MTP) experts not among them
    assert plan["total_bytes"] <= plan["budget_bytes"]


def test_the_mtp_layer_is_neither_priced_nor_loaded(tmp_path):
    spec = load_model_config(GLM_45_AIR)
    assert spec.num_layers == 46 and spec.mtp_layers == 1
    for name in ("model.layers.46.eh_proj.weight", "model.layers.46.mlp.experts.0.up_proj.weight"):
        assert not is_served(name, spec) and not resident_tensor(name, spec) and not routed_expert_tensor(name, spec)
    assert resident_tensor("model.layers.45.self_attn.q_proj.weight", spec)
    assert routed_expert_tensor("model.layers.45.mlp.experts.3.up_proj.weight", spec)
    (tmp_path / "config.json").write_text((GLM_45_AIR / "config.json").read_text())
    tensors = {
        "model.layers.45.input_layernorm.weight": np.zeros((4096,), dtype=np.float32),  # 8 KiB at bf16
        "model.layers.46.enorm.weight": np.zeros((4096,), dtype=np.float32),  # the MTP layer's: not priced
        "model.layers.46.self_attn.q_proj.weight": np.zeros((64, 64), dtype=np.float32),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert resident_weight_bytes_from_checkpoint(tmp_path, "bfloat16", spec) == 8192
    assert resident_weight_bytes_from_checkpoint(tmp_path, "bfloat16") == 8192 + 8192 + 8192  # without the spec


def test_the_mtp_layers_tensors_are_skipped_on_load_and_only_those():
    from model_harness import PagedRunner

    hf, spec = tiny_model("glm4_moe", seed=41)
    spec = dataclasses.replace(spec, mtp_layers=1)
    n, h = spec.num_layers, spec.hidden_size
    mtp = {
        f"model.layers.{n}.eh_proj.weight": torch.zeros(h, 2 * h),
        f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.zeros(spec.moe_intermediate_size, h),
        f"model.layers.{n}.self_attn.q_proj.bias": torch.zeros(spec.num_attention_heads * spec.head_dim),
    }

    class WithMtp:
        def __init__(self, extra):
            self.extra = extra

        def state_dict(self):
            return {**hf.state_dict(), **self.extra}

    PagedRunner(spec, WithMtp(mtp), page_size=4)  # loads
    with pytest.raises(WeightLoadError, match=f"layers.{n + 1}"):  # past the MTP layers: not this model's
        PagedRunner(spec, WithMtp({f"model.layers.{n + 1}.eh_proj.weight": torch.zeros(h, 2 * h)}), page_size=4)
    with pytest.raises(WeightLoadError, match=f"layers.{n}"):  # a checkpoint without MTP layers has none to skip
        PagedRunner(dataclasses.replace(spec, mtp_layers=0), WithMtp(mtp), page_size=4)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(n_group=3), "n_group (3) must divide the 128 experts"),
        (dict(n_group=4, topk_group=5), "topk_group (5) must be between 1 and n_group (4)"),
        (dict(n_group=64, topk_group=2, num_experts_per_tok=8), "num_experts_per_tok (8) exceeds"),
    ],
)
def test_routing_groups_config_json_cannot_serve_are_refused_by_field(fields, message):
    raw = json.loads((GLM_45_AIR / "config.json").read_text())
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_model_config({**raw, **fields})


def test_the_softmax_router_refuses_what_only_the_sigmoid_router_computes():
    _, spec = tiny_model("qwen3_moe", seed=42)
    from ferry.plan.model_config import _validate

    for field, value in (("router_score_bias", True), ("router_groups", 2), ("routed_scaling_factor", 2.0)):
        with pytest.raises(ConfigError, match="sigmoid router scoring only"):
            _validate(dataclasses.replace(spec, **{field: value}), "config.json")


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory) -> Path:
    """`ferry make-tiny-model --arch glm4_moe`, its weights redrawn as tiny_models.py does (a nonzero
    e_score_correction_bias among them) and saved back by transformers."""
    out = redrawn_tiny_checkpoint(tmp_path_factory.mktemp("glm"), "glm4_moe")
    bias = load_file(out / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0
    return out


ARGS = ("--prompt-ids", ",".join(str((i * 37 + 11) % 200) for i in range(70)), "--max-tokens", "8", "--ignore-eos")
ARGS += ("--dtype", "float32", "--max-prefill-tokens", "80")


def test_offloaded_generation_equals_resident_and_transformers(glm_checkpoint, capsys):
    resident = ferry_generate(capsys, glm_checkpoint, *ARGS)
    experts = resident["plan"]["experts"]
    assert experts["slots"] == experts["total"] == 2 * 8  # two MoE layers of 8: the first layer is dense
    assert resident["token_ids"] == transformers_greedy(glm_checkpoint, resident["prompt_token_ids"], 8)
    offloaded = ferry_generate(capsys, glm_checkpoint, *ARGS, "--moe-cache-size", str(experts["min_slots"]))
    assert offloaded["expert_cache"]["misses"] > 0
    assert offloaded["token_ids"] == resident["token_ids"]
    assert offloaded["logprobs"] == resident["logprobs"]
