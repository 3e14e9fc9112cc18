"""Model loading: local directories, the hub cache (offline), checkpoint passes, dummy weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ferry.plan.costs import is_routed_expert, resident_weight_shapes
from ferry.services.worker.dummy_weights import dummy_tensor, iter_dummy_tensors, routed_expert_shapes
from ferry.services.worker.loader import open_model, resident_weights, routed_expert_weights
from ferry.shared.errors import ModelLoadError


def test_local_directory_two_passes_cover_the_checkpoint(tiny_model):
    from safetensors import safe_open

    files = open_model(str(tiny_model))
    assert files.load_format == "safetensors" and (files.model_dir / "tokenizer.json").is_file()
    resident = dict(resident_weights(files, torch.float32, "cpu", progress=False))
    experts = dict(routed_expert_weights(files, torch.float32, "cpu", progress=False))
    assert set(resident) == set(resident_weight_shapes(files.spec))
    assert all(is_routed_expert(n) for n in experts) and len(experts) == len(routed_expert_shapes(files.spec))
    with safe_open(tiny_model / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(resident) | set(experts)
        assert torch.equal(resident["model.norm.weight"], f.get_tensor("model.norm.weight"))


def test_sharded_checkpoint_read_through_its_index(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny_models["qwen3_moe"]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in halves.items():
        save_file({n: tensors[n] for n in shard_names}, dst / shard)
        weight_map.update({n: shard for n in shard_names})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    files = open_model(str(dst))
    got = dict(resident_weights(files, torch.float32, "cpu", progress=False))
    got.update(routed_expert_weights(files, torch.float32, "cpu", progress=False))
    assert got.keys() == tensors.keys() and all(torch.equal(got[n], tensors[n]) for n in names)
    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002"):
        open_model(str(dst))


def _hub_cache_snapshot(cache, repo_id, src):
    """Lay out `src` the way huggingface_hub's cache does: blobs, a snapshot of symlinks, a ref."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = repo / "blobs" / f"blob{i:04d}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hub_id_resolved_from_the_local_cache(tiny_models, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = _hub_cache_snapshot(cache, "ferry-test/tiny-moe", tiny_models["qwen3_moe"])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = open_model("ferry-test/tiny-moe")
    assert files.model_dir == snapshot and files.spec.arch == "qwen3_moe"
    assert len(dict(resident_weights(files, torch.float32, "cpu", progress=False))) > 0


def test_missing_hub_id_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelLoadError, match=r"not in the Hugging Face cache.*huggingface-cli download nobody/nothing"):
        open_model("nobody/nothing")


def test_bad_local_paths_are_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        open_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="not a hub id"):
        open_model(str(tmp_path / "does" / "not" / "exist"))


def test_checkpoint_without_weights_needs_dummy(tiny_models, tmp_path):
    (tmp_path / "config.json").write_bytes((tiny_models["qwen3_moe"] / "config.json").read_bytes())
    with pytest.raises(ModelLoadError, match="--load-format dummy"):
        open_model(str(tmp_path))
    assert open_model(str(tmp_path), load_format="dummy").load_format == "dummy"


def test_dummy_weights_have_checkpoint_shapes_and_are_deterministic(tiny_model):
    files = open_model(str(tiny_model), load_format="dummy")
    spec = files.spec
    a = dict(resident_weights(files, torch.bfloat16, "cpu"))
    b = dict(resident_weights(files, torch.bfloat16, "cpu"))
    shapes = resident_weight_shapes(spec)
    assert {n: tuple(t.shape) for n, t in a.items()} == shapes
    assert all(torch.equal(a[n], b[n]) and a[n].dtype == torch.bfloat16 for n in a)
    # seeded by name: different tensors of one shape differ, and a tensor does not depend on the others
    assert not torch.equal(a["model.layers.0.mlp.gate.weight"], a["model.layers.1.mlp.gate.weight"])
    alone = dummy_tensor(
        spec,
        "model.layers.1.mlp.gate.weight",
        shapes["model.layers.1.mlp.gate.weight"],
        torch.bfloat16,
        torch.device("cpu"),
    )
    assert torch.equal(alone, a["model.layers.1.mlp.gate.weight"])
    experts = dict(routed_expert_weights(files, torch.bfloat16, "cpu"))
    assert {n: tuple(t.shape) for n, t in experts.items()} == routed_expert_shapes(spec)
    # the recipe of honest routing: a strong token embedding, weak writes into the residual stream
    std = {
        n: a[n].float().std().item()
        for n in (
            "model.embed_tokens.weight",
            "model.layers.1.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate.weight",
        )
    }
    assert 0.9 < std["model.embed_tokens.weight"] < 1.1
    assert 0.0015 < std["model.layers.1.self_attn.o_proj.weight"] < 0.0025
    assert 0.015 < std["model.layers.0.mlp.gate.weight"] < 0.025


def test_dummy_norms_and_decay_terms_are_plausible(tiny_models):
    spec = open_model(str(tiny_models["qwen3_5_moe"]), load_format="dummy").spec
    t = dict(iter_dummy_tensors(spec, torch.float32, "cpu", routed_experts=False))
    # Qwen3.5 norms compute x * (1 + w): identity at w = 0; its gated norm multiplies by w: identity at 1
    assert torch.all(t["model.norm.weight"] == 0) and torch.all(t["model.layers.1.self_attn.q_norm.weight"] == 0)
    assert torch.all(t["model.layers.0.linear_attn.norm.weight"] == 1)
    a = t["model.layers.0.linear_attn.A_log"].exp()
    assert torch.all((a >= 1) & (a <= 16)) and torch.all(t["model.layers.0.linear_attn.dt_bias"] == 1)
    spec3 = open_model(str(tiny_models["qwen3_moe"]), load_format="dummy").spec
    t3 = dict(iter_dummy_tensors(spec3, torch.float32, "cpu", routed_experts=False))
    assert torch.all(t3["model.norm.weight"] == 1)


class _CountingStore:
    """Counts the experts handed to it (the model under test needs somewhere to put them)."""

    def __init__(self, num_experts):
        self.num_experts, self.loaded = num_experts, set()

    def load_expert(self, moe_layer, expert, gate, up, down):
        self.loaded.add((moe_layer, expert))

    def forward(self, *args):
        raise AssertionError("no forward in this test")


def _qwen3_next_spec():
    from transformers import Qwen3NextConfig

    from ferry.plan.model_config import parse_model_config

    config = Qwen3NextConfig(
        num_hidden_layers=4,
        hidden_size=256,
        num_experts=16,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        vocab_size=1000,
    )
    return parse_model_config(config.to_dict())


@pytest.mark.parametrize("config_dir", ["qwen3-30b-a3b", "qwen3.6-35b-a3b", "qwen3_next"])
def test_dummy_names_and_shapes_are_what_the_real_models_load(config_dir):
    """--load-format dummy is for big shapes: its names and shapes for the published configs must be
    exactly what the model accepts (checked on the meta device: no memory, no compute)."""
    from pathlib import Path

    from ferry.plan.model_config import load_model_config
    from ferry.services.worker.models import build_model

    if config_dir == "qwen3_next":  # no published config in tests/data: transformers' defaults, made small
        spec = _qwen3_next_spec()
    else:
        spec = load_model_config(Path(__file__).parents[1] / "data" / "models" / config_dir)
    store = _CountingStore(spec.num_experts)
    model = build_model(spec, torch.bfloat16, "meta", store)
    shapes = dict(resident_weight_shapes(spec), **routed_expert_shapes(spec))
    model.load_weights((n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in shapes.items())
    assert len(store.loaded) == spec.total_experts
