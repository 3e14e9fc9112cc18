"""Model families: each registered family builds, its two halves (plan/model_families/, services/worker/models/)
agree on the checkpoint's tensors, an unknown architecture is refused by name, a new family is one
registration, and no module outside a family's branches on a family's name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from model_harness import PagedRunner, make_pools
from tiny_models import tiny_model

from ferry.plan import model_families as plan_families
from ferry.plan.costs import resident_weight_shapes
from ferry.plan.model_config import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec, parse_model_config
from ferry.plan.model_families import ModelFamily
from ferry.plan.model_families.spec_fields import (
    attention_fields,
    gated_deltanet_fields,
    hybrid_layer_types,
    mlp_fields,
    sparse_step_moe_layers,
)
from ferry.plan.model_families.weight_shapes import attention_shapes, decoder_shapes, gated_deltanet_shapes
from ferry.services.worker.dummy_weights import iter_dummy_tensors, routed_expert_shapes
from ferry.services.worker.layers.attention import PagedAttention
from ferry.services.worker.layers.gated_deltanet import GatedDeltaNet
from ferry.services.worker.models import build_model, registry
from ferry.services.worker.models.decoder import DecoderFamily
from ferry.services.worker.offload.stores.resident import ResidentExperts
from ferry.shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


def _built(spec: ModelSpec):
    pools = make_pools(spec, torch.float32, 8, 4, 2)
    return build_model(
        spec, torch.float32, "cpu", ResidentExperts(pools.experts, len(spec.moe_layer_indices), spec.num_experts)
    )


@pytest.mark.parametrize("name", sorted(plan_families.families()))
def test_every_registered_family_builds_and_its_halves_name_the_same_tensors(name):
    """tests/unit/tiny_models.py must know a new family's tiny transformers model (its tests)."""
    _, spec = tiny_model(name, seed=31)
    assert spec.arch == name
    model = _built(spec)
    assert model.family is registry.families()[name]
    # the planner's resident tensors and the routed experts are exactly what the model loads
    assert model.checkpoint_shapes() == {**resident_weight_shapes(spec), **routed_expert_shapes(spec)}


def test_every_plan_family_has_a_worker_half():
    assert set(plan_families.families()) == set(registry.families())


def test_an_unknown_architecture_is_refused_naming_config_jsons_architectures():
    raw = {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "num_hidden_layers": 2}
    with pytest.raises(ConfigError) as err:
        parse_model_config(raw)
    message = str(err.value)
    assert "model_type 'olmoe' is not supported" in message
    assert "architectures ['OlmoeForCausalLM']" in message
    assert "qwen3_moe" in message  # what is served instead


def test_without_model_type_the_architectures_entry_finds_the_family():
    hf, spec = tiny_model("qwen3_moe", seed=32)
    raw = hf.config.to_dict()
    del raw["model_type"]
    raw["architectures"] = ["Qwen3MoeForCausalLM"]  # as save_pretrained writes it
    assert parse_model_config(raw).arch == "qwen3_moe"
    raw["architectures"] = ["SomethingElseForCausalLM"]
    with pytest.raises(ConfigError, match=r"architectures \['SomethingElseForCausalLM'\]"):
        parse_model_config(raw)


def test_a_spec_of_a_family_the_worker_lacks_is_refused_by_name():
    _, spec = tiny_model("qwen3_moe", seed=33)
    with pytest.raises(ConfigError, match="model family 'no_such_family' has no implementation"):
        _built(dataclasses.replace(spec, arch="no_such_family"))


# ---- a family added by registering it: plain norms, no shared expert, Gated DeltaNet and attention layers ----


def _toy_fields(cfg, where):
    num_layers = int(cfg["num_hidden_layers"])
    return dict(
        layer_types=hybrid_layer_types(cfg, num_layers, where),
        moe_layers=sparse_step_moe_layers(cfg, num_layers),
        **attention_fields(cfg, where, partial_rotary_factor=1.0, output_gate=False),
        **mlp_fields(cfg, norm_topk_prob=True, shared_expert=False),
        **gated_deltanet_fields(cfg),
    )


class _ToyHybrid(DecoderFamily):
    def mixer(self, spec, layer, rotary, dtype, device):
        if spec.layer_types[layer] == LINEAR_ATTENTION:
            return "linear_attn", GatedDeltaNet(spec, layer, dtype, device)
        return "self_attn", PagedAttention(spec, layer, rotary, dtype, device)


TOY_CONFIG = dict(
    model_type="toy_hybrid",
    architectures=["ToyHybridForCausalLM"],
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    layer_types=[LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    intermediate_size=48,
    mlp_only_layers=[1],
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    torch_dtype="float32",
)


@pytest.fixture
def toy_family(monkeypatch):
    """The toy family registered on both sides for this test only."""
    monkeypatch.setattr(plan_families, "_FAMILIES", dict(plan_families.families()))
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry.families()))
    plan_families.register(
        ModelFamily(
            name="toy_hybrid",
            model_types=("toy_hybrid",),
            architectures=("ToyHybridForCausalLM",),
            spec_fields=_toy_fields,
            resident_weight_shapes=lambda spec: decoder_shapes(
                spec, {FULL_ATTENTION: attention_shapes, LINEAR_ATTENTION: gated_deltanet_shapes}
            ),
        )
    )
    return registry.register(_ToyHybrid("toy_hybrid"))


class _Weights:
    def __init__(self, spec):
        self.weights = [
            *iter_dummy_tensors(spec, torch.float32, "cpu", False),
            *iter_dummy_tensors(spec, torch.float32, "cpu", True),
        ]

    def state_dict(self):
        return dict(self.weights)


def test_a_new_family_is_one_registration(toy_family):
    spec = parse_model_config(TOY_CONFIG)
    assert spec.arch == "toy_hybrid" and not spec.zero_centered_norms and spec.shared_expert_intermediate_size == 0
    model = _built(spec)
    assert model.family is toy_family
    assert [layer.mixer_name for layer in model.layers] == ["linear_attn", "self_attn", "linear_attn"]
    assert model.checkpoint_shapes() == {**resident_weight_shapes(spec), **routed_expert_shapes(spec)}
    # it serves: the prompt in one step and in two chunks (K/V and linear states carried) agree
    weights = _Weights(spec)
    whole = PagedRunner(spec, weights, page_size=4).step([(1, PROMPT)])[0]
    chunked = PagedRunner(spec, weights, page_size=4)
    first = chunked.step([(1, PROMPT[:6])])[0]
    second = chunked.step([(1, PROMPT[6:])])[0]
    assert torch.isfinite(whole).all()
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-4)


# ---- no module but a family's names a family ----

FAMILY_MODULES = (
    "plan/model_families/",
    "services/worker/models/qwen3_moe.py",
    "services/worker/models/qwen3_hybrid.py",
    "services/worker/models/glm4_moe.py",
    "services/worker/models/gpt_oss.py",
    "services/worker/models/gemma4.py",
    "services/api/gemma4_format.py",  # the family's chat markup (its parsers' name is the family's, as in vLLM)
)
# which model to make is a choice, not a branch: the demo's model and make-tiny-model's default
CHOICES = {("services/demo_model.py", "qwen3_moe"), ("services/make_tiny_model.py", "qwen3_moe")}


def _string_constants(tree: ast.AST):
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_no_module_outside_a_familys_names_one():
    names = {n for f in plan_families.families().values() for n in (f.name, *f.model_types, *f.architectures)}
    found = []
    for folder in ("plan", "services", "shared", "kernels"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith(FAMILY_MODULES):
                continue
            for node in _string_constants(ast.parse(path.read_text())):
                if node.value in names and (rel, node.value) not in CHOICES:
                    found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, "a family's name outside its module (register it instead): " + ", ".join(found)
