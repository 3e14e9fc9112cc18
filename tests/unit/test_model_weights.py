"""Checkpoint loading: both expert layouts, the multimodal wrapper's names, and clear errors."""

from __future__ import annotations

import os

import pytest
import torch
from model_harness import PagedRunner, assert_logits_close, make_pools
from safetensors.torch import load_file
from tiny_models import _config, _redraw, tiny_model
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from ferry.plan.model_config import parse_model_config
from ferry.services.worker.models import WeightLoadError, build_model
from ferry.services.worker.offload.stores.resident import ResidentExperts
from ferry.shared.errors import ConfigError

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


def _prompt_logits(runner: PagedRunner) -> torch.Tensor:
    return runner.step([(1, PROMPT)])[0]


class _FromWeights(PagedRunner):
    """A runner whose model loads the given (name, tensor) pairs instead of the HF state_dict."""

    def __init__(self, spec, weights, page_size=4):
        class _Source:
            def state_dict(self):
                return dict(weights)

        super().__init__(spec, _Source(), page_size)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_saved_per_expert_checkpoint_loads_like_the_fused_state_dict(arch, tmp_path):
    hf, spec = tiny_model(arch, seed=21)
    hf.save_pretrained(tmp_path)
    on_disk = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in on_disk), "save_pretrained wrote per-expert tensors"
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in hf.state_dict()), "in memory they are fused"
    fused = _prompt_logits(PagedRunner(spec, hf, 4))
    per_expert = _prompt_logits(_FromWeights(spec, on_disk.items()))
    torch.testing.assert_close(per_expert, fused, rtol=0, atol=0)
    with torch.no_grad():
        assert_logits_close(fused, hf(torch.tensor([PROMPT])).logits[0])


def test_multimodal_qwen3_5_moe_checkpoint_serves_its_text_tower(tmp_path):
    text, _ = _config("qwen3_5_moe")
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=4,
        temporal_patch_size=1,
        spatial_merge_size=1,
        num_position_embeddings=16,
    )
    torch.manual_seed(0)
    hf = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text.to_dict(), vision_config=vision)).eval()
    _redraw(hf, torch.Generator().manual_seed(0))
    hf.save_pretrained(tmp_path)
    on_disk = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert any(k.startswith("model.language_model.layers.") for k in on_disk)
    assert any(k.startswith("model.visual.") for k in on_disk)
    on_disk["mtp.layers.0.input_layernorm.weight"] = torch.zeros(32)  # multi-token prediction: skipped too
    spec = parse_model_config(hf.config.to_dict(), where="tiny multimodal")
    assert spec.arch == "qwen3_5_moe"
    ours = _prompt_logits(_FromWeights(spec, on_disk.items()))
    with torch.no_grad():
        assert_logits_close(ours, hf(input_ids=torch.tensor([PROMPT])).logits[0])


def _loadable(arch="qwen3_next"):
    hf, spec = tiny_model(arch, seed=22)
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    experts = ResidentExperts(pools.experts, len(spec.moe_layer_indices), spec.num_experts)
    return build_model(spec, torch.float32, "cpu", experts), dict(hf.state_dict())


def test_missing_tensor_is_named():
    model, weights = _loadable()
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(WeightLoadError, match=r"layers\.1\.self_attn\.k_norm\.weight"):
        model.load_weights(weights.items())


def test_missing_expert_is_named(tmp_path):
    hf, spec = tiny_model("qwen3_moe", seed=23)
    hf.save_pretrained(tmp_path)
    weights = load_file(os.path.join(tmp_path, "model.safetensors"))
    del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    model = build_model(spec, torch.float32, "cpu", ResidentExperts(pools.experts, 2, spec.num_experts))
    with pytest.raises(WeightLoadError, match=r"expert\[1\]\[2\]"):
        model.load_weights(weights.items())


def test_missing_part_of_a_fused_projection_is_named():
    model, weights = _loadable()
    del weights["model.layers.0.linear_attn.in_proj_ba.weight"]
    with pytest.raises(WeightLoadError, match=r"layers\.0\.linear_attn\.in_proj\[a\].*in_proj\[b\]"):
        model.load_weights(weights.items())


def test_unexpected_tensor_is_named():
    model, weights = _loadable()
    weights["model.layers.0.self_attn.rotary.weight"] = torch.zeros(3)
    with pytest.raises(WeightLoadError, match=r"unexpected .* 'model\.layers\.0\.self_attn\.rotary\.weight'"):
        model.load_weights(weights.items())


def test_experts_on_a_dense_layer_are_unexpected():
    hf, spec = tiny_model("qwen3_moe", seed=24, mlp_only_layers=[0])
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    model = build_model(spec, torch.float32, "cpu", ResidentExperts(pools.experts, 1, spec.num_experts))
    weights = dict(hf.state_dict())
    weights["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(16, 32)
    with pytest.raises(WeightLoadError, match="layer 0 has no routed experts"):
        model.load_weights(weights.items())


def test_wrong_shape_is_named():
    model, weights = _loadable()
    weights["model.norm.weight"] = torch.zeros(31)
    with pytest.raises(WeightLoadError, match=r"'model\.norm\.weight' has shape \(31,\), expected \(32,\)"):
        model.load_weights(weights.items())


def test_expert_store_must_match_num_experts():
    _, spec = tiny_model("qwen3_moe", seed=25)
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    store = ResidentExperts(pools.experts, 1, spec.num_experts - 1)
    with pytest.raises(ConfigError, match="num_experts"):
        build_model(spec, torch.float32, "cpu", store)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_checkpoint_shapes_are_what_save_pretrained_writes(arch, tmp_path):
    hf, spec = tiny_model(arch, seed=26, mlp_only_layers=[1] if arch != "qwen3_5_moe" else [])
    hf.save_pretrained(tmp_path)
    on_disk = {k: tuple(v.shape) for k, v in load_file(os.path.join(tmp_path, "model.safetensors")).items()}
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    experts = ResidentExperts(pools.experts, len(spec.moe_layer_indices), spec.num_experts)
    model = build_model(spec, torch.float32, "cpu", experts)
    shapes = model.checkpoint_shapes()
    assert shapes == on_disk
    model.load_weights((name, torch.randn(shape)) for name, shape in shapes.items())  # dummy weights load


def test_sliding_window_attention_is_refused():
    _, spec = tiny_model("qwen3_moe", seed=27, use_sliding_window=True, sliding_window=8)
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    with pytest.raises(ConfigError, match="use_sliding_window"):
        build_model(spec, torch.float32, "cpu", ResidentExperts(pools.experts, 2, spec.num_experts))


def test_other_activations_are_refused():
    _, spec = tiny_model("qwen3_moe", seed=28, hidden_act="gelu")
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    with pytest.raises(ConfigError, match="hidden_act 'gelu'"):
        build_model(spec, torch.float32, "cpu", ResidentExperts(pools.experts, 2, spec.num_experts))


def test_no_checkpoint_tensor_is_alive_when_the_weights_are_measured():
    """Boot measures the weights and plans between the two passes, inside the iterator's step after the last
    resident tensor (boot.py's `_then`): a tensor the loader still holds there is counted as weights (on CUDA,
    with the whole allocator segment it was carved from)."""
    import weakref

    model, weights = _loadable()
    given: list[tuple[str, weakref.ref]] = []
    alive: list[str] = []

    def tracked():
        for name, tensor in weights.items():
            t = tensor.clone()
            given.append((name, weakref.ref(t)))
            yield name, t
            del t
        alive.extend(n for n, ref in given if ref() is not None)  # where boot's plan_and_allocate runs

    model.load_weights(tracked())
    assert len(given) == len(weights)
    assert alive == []
