"""The MTP draft head of Qwen3.5/3.6 (services/worker/models/mtp_head.py, plan/mtp_layer.py): its forward against an
independent float64 reference written from the layer's structure, its loading from a checkpoint's `mtp.` tensors,
its pricing; its drafting in decoding: tests/unit/test_mtp_drafting.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ferry.plan.costs import ALLOC_GRANULE, resident_weight_bytes_from_checkpoint
from ferry.plan.model_config import load_model_config, parse_model_config
from ferry.plan.mtp_layer import (
    check_mtp,
    mtp_checkpoint_name,
    mtp_expert_shapes,
    mtp_kv_bytes_per_token,
    mtp_name,
    mtp_resident_bytes,
    mtp_resident_weight_shapes,
)
from ferry.services.make_tiny_model import make_tiny_model
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.services.worker.models.mtp_head import MtpHead, random_mtp_tensors, read_mtp_tensors
from ferry.services.worker.models.weights import WeightLoadError
from ferry.shared.errors import ConfigError
from ferry.shared.speculation import speculation_problems
from ferry.shared.units import round_up
from tests.unit.kernels import mtp_head_entry

MODELS = Path(__file__).resolve().parents[1] / "data/models"
GLM_45_AIR = MODELS / "glm-4.5-air"


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("mtp") / "qwen3_5_moe", "qwen3_5_moe", seed=0, mtp=True)


@pytest.fixture(scope="module")
def spec(mtp_model):
    return load_model_config(mtp_model)


def _head(spec, tensors=None):
    rotary = RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta)
    head = MtpHead(spec, rotary, torch.float32)
    head.load_weights((tensors or random_mtp_tensors(spec, seed=3)).items())
    return head


# ---- the independent reference: one token at a time, float64, written from the structure ----------------------------


def _norm(x, w, eps):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _turn(v, position, rotary_dim, theta):
    """The first rotary_dim channels turn as pairs (i, i + rotary_dim / 2) by position * theta^(-2i / rotary_dim)."""
    out = v.clone()
    half = rotary_dim // 2
    for i in range(half):
        angle = position * theta ** (-2.0 * i / rotary_dim)
        c, s = math.cos(angle), math.sin(angle)
        a, b = v[..., i].clone(), v[..., i + half].clone()
        out[..., i], out[..., i + half] = a * c - b * s, b * c + a * s
    return out


def reference_mtp(spec, t, hidden, embeds, positions, concat_embedding_first=True, swap_pre_fc_norms=False):
    """The draft head's hidden states, from the checkpoint tensors `t` (name -> tensor) alone. The two keyword
    arguments plant the faults a head must not have (for the test that the comparison catches them)."""
    t = {k: v.double() for k, v in t.items()}
    eps, hd, nh, kvh = spec.rms_norm_eps, spec.head_dim, spec.num_attention_heads, spec.num_kv_heads
    rotary_dim = int(hd * spec.partial_rotary_factor)
    p = "mtp.layers.0."
    norm_e, norm_h = t["mtp.pre_fc_norm_embedding.weight"], t["mtp.pre_fc_norm_hidden.weight"]
    if swap_pre_fc_norms:
        norm_e, norm_h = norm_h, norm_e
    e, h = _norm(embeds.double(), norm_e, eps), _norm(hidden.double(), norm_h, eps)
    x = (torch.cat([e, h], -1) if concat_embedding_first else torch.cat([h, e], -1)) @ t["mtp.fc.weight"].T
    a = _norm(x, t[p + "input_layernorm.weight"], eps)
    qg = (a @ t[p + "self_attn.q_proj.weight"].T).view(-1, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (a @ t[p + "self_attn.k_proj.weight"].T).view(-1, kvh, hd)
    v = (a @ t[p + "self_attn.v_proj.weight"].T).view(-1, kvh, hd)
    q = _norm(q, t[p + "self_attn.q_norm.weight"], eps)
    k = _norm(k, t[p + "self_attn.k_norm.weight"], eps)
    q = torch.stack([_turn(q[j], int(positions[j]), rotary_dim, spec.rope_theta) for j in range(len(q))])
    k = torch.stack([_turn(k[j], int(positions[j]), rotary_dim, spec.rope_theta) for j in range(len(k))])
    attn = torch.zeros(len(q), nh, hd, dtype=torch.float64)
    for j in range(len(q)):
        for head in range(nh):
            kv = head // (nh // kvh)
            seen = [m for m in range(len(q)) if positions[m] <= positions[j]]
            scores = torch.stack([q[j, head] @ k[m, kv] for m in seen]) / math.sqrt(hd)
            probs = torch.softmax(scores, 0)
            attn[j, head] = sum(probs[n] * v[m, kv] for n, m in enumerate(seen))
    attn = attn.reshape(len(q), -1) * torch.sigmoid(gate.reshape(len(q), -1))
    x = x + attn @ t[p + "self_attn.o_proj.weight"].T
    m = _norm(x, t[p + "post_attention_layernorm.weight"], eps)
    moe = torch.zeros_like(m)
    for j in range(len(m)):
        probs = torch.softmax(m[j] @ t[p + "mlp.gate.weight"].T, 0)
        top = torch.topk(probs, spec.num_experts_per_tok)
        for w, expert in zip(top.values / top.values.sum(), top.indices.tolist()):
            ep = f"{p}mlp.experts.{expert}."
            act = torch.nn.functional.silu(m[j] @ t[ep + "gate_proj.weight"].T) * (m[j] @ t[ep + "up_proj.weight"].T)
            moe[j] += w * (act @ t[ep + "down_proj.weight"].T)
        s = f"{p}mlp.shared_expert."
        act = torch.nn.functional.silu(m[j] @ t[s + "gate_proj.weight"].T) * (m[j] @ t[s + "up_proj.weight"].T)
        shared_gate = torch.sigmoid(m[j] @ t[p + "mlp.shared_expert_gate.weight"].T)
        moe[j] += shared_gate * (act @ t[s + "down_proj.weight"].T)
    return _norm(x + moe, t["mtp.norm.weight"], eps)


def _inputs(spec, n=5):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(n, spec.hidden_size, generator=g)
    embeds = torch.randn(n, spec.hidden_size, generator=g) * 0.05
    return hidden, embeds, torch.arange(3, 3 + n)


def test_the_head_computes_what_the_reference_does(spec):
    tensors = random_mtp_tensors(spec, seed=3)
    hidden, embeds, positions = _inputs(spec)
    got = _head(spec, tensors)(hidden, embeds, positions)
    want = reference_mtp(spec, tensors, hidden, embeds, positions)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fault", [dict(concat_embedding_first=False), dict(swap_pre_fc_norms=True)])
def test_the_comparison_catches_a_planted_fault(spec, fault):
    """The reference with the concat order reversed or the two input norms swapped is far from the head: a head with
    that fault would fail the test above."""
    tensors = random_mtp_tensors(spec, seed=3)
    hidden, embeds, positions = _inputs(spec)
    got = _head(spec, tensors)(hidden, embeds, positions).double()
    faulty = reference_mtp(spec, tensors, hidden, embeds, positions, **fault)
    assert (got - faulty).abs().max() > 1e-2


def test_a_position_sees_only_itself_and_earlier_ones(spec):
    head = _head(spec)
    hidden, embeds, positions = _inputs(spec)
    full = head(hidden, embeds, positions)
    torch.testing.assert_close(head(hidden[:3], embeds[:3], positions[:3]), full[:3], rtol=1e-5, atol=1e-5)


def test_the_head_loads_the_checkpoints_mtp_tensors(mtp_model, spec):
    head = MtpHead(spec, RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta), torch.float32)
    head.load_weights(read_mtp_tensors(mtp_model, spec))
    with safe_open(mtp_model / "mtp.safetensors", framework="pt") as f:
        fc = f.get_tensor("mtp.fc.weight")
        down = f.get_tensor("mtp.layers.0.mlp.experts.5.down_proj.weight")
        up = f.get_tensor("mtp.layers.0.mlp.experts.2.up_proj.weight")
    assert torch.equal(head.fc.weight, fc)
    assert torch.equal(head.layers[0].mlp.down[5], down)
    assert torch.equal(head.layers[0].mlp.gate_up[2][spec.moe_intermediate_size :], up)


def test_fused_experts_load_as_per_expert_ones(spec):
    tensors = random_mtp_tensors(spec, seed=4)
    i, fused = spec.moe_intermediate_size, {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            fused[name] = tensor
    e = range(spec.num_experts)
    p = "mtp.layers.0.mlp.experts."
    fused[p + "gate_up_proj"] = torch.stack(
        [torch.cat([tensors[f"{p}{x}.gate_proj.weight"], tensors[f"{p}{x}.up_proj.weight"]]) for x in e]
    )
    fused[p + "down_proj"] = torch.stack([tensors[f"{p}{x}.down_proj.weight"] for x in e])
    assert fused[p + "gate_up_proj"].shape == (spec.num_experts, 2 * i, spec.hidden_size)
    hidden, embeds, positions = _inputs(spec)
    want = _head(spec, tensors)(hidden, embeds, positions)
    torch.testing.assert_close(_head(spec, fused)(hidden, embeds, positions), want, rtol=0, atol=0)


def test_a_missing_unexpected_or_misshapen_tensor_is_named(spec):
    tensors = random_mtp_tensors(spec, seed=3)
    missing = dict(tensors)
    del missing["mtp.layers.0.mlp.experts.7.up_proj.weight"]
    with pytest.raises(WeightLoadError, match="lacks 1 MTP tensors.*mtp.layers.0.mlp.experts.7.up_proj.weight"):
        _head(spec, missing)
    with pytest.raises(WeightLoadError, match="unexpected MTP tensor 'mtp.extra.weight'"):
        _head(spec, dict(tensors, **{"mtp.extra.weight": torch.zeros(3)}))
    with pytest.raises(WeightLoadError, match="mtp.fc.weight"):
        _head(spec, dict(tensors, **{"mtp.fc.weight": torch.zeros(3, 3)}))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plan_prices_the_heads_weights_exactly(spec, dtype):
    """The plan's bytes are what the head allocates: one allocation a parameter, its experts stacked in two."""
    rotary = RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta)
    head = MtpHead(spec, rotary, getattr(torch, dtype))
    assert mtp_resident_bytes(spec, dtype) == sum(round_up(p.nbytes, ALLOC_GRANULE) for p in head.parameters())
    assert mtp_kv_bytes_per_token(spec, dtype) == 2 * spec.num_kv_heads * spec.head_dim * head.fc.weight.itemsize


# Qwen3.5-35B-A3B's text model as its config.json has it (the parts the MTP layer's shapes read)
QWEN35_35B = dict(
    model_type="qwen3_5_moe_text",
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=40,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    attn_output_gate=True,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_value_head_dim=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
)


def test_the_price_counts_every_mtp_tensor_of_a_full_size_model():
    """Qwen3.5-35B-A3B's MTP layer in bf16, tensor by tensor: fc [2048, 4096]; gated attention (q_proj [2 x 16 x 256,
    2048]: each head's query and gate), k and v [2 x 256, 2048], o [2048, 4096]; the router [256, 2048], the shared
    expert's three [512, 2048] and its gate [1, 2048]; 256 experts of three 2048 x 512 projections; five norms of
    2048 and the two per-head norms of 256 (each under the 512-byte granule rounded up)."""
    spec = parse_model_config(QWEN35_35B)
    h = 2048
    matrices = h * 2 * h + 2 * 16 * 256 * h + 2 * 2 * 256 * h + h * 16 * 256 + 256 * h + 3 * 512 * h + h
    experts = 256 * 3 * h * 512
    assert spec.mtp_draft_layers == 1
    assert mtp_resident_bytes(spec, "bfloat16") == (matrices + experts) * 2 + 5 * h * 2 + 2 * 512
    assert mtp_kv_bytes_per_token(spec, "bfloat16") == 2 * 2 * 256 * 2


def test_the_target_neither_loads_nor_prices_the_mtp_tensors(mtp_model, tmp_path):
    plain = make_tiny_model(tmp_path / "plain", "qwen3_5_moe", seed=0)
    spec = load_model_config(mtp_model)
    assert resident_weight_bytes_from_checkpoint(mtp_model, "bfloat16", spec) == resident_weight_bytes_from_checkpoint(
        plain, "bfloat16", load_model_config(plain)
    )


def test_the_spec_counts_the_mtp_layers(mtp_model, spec, tmp_path):
    assert spec.mtp_draft_layers == 1 and not spec.mtp_dedicated_embeddings
    assert json.loads((mtp_model / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    plain = load_model_config(make_tiny_model(tmp_path / "plain", "qwen3_5_moe", seed=0))
    with pytest.raises(ConfigError, match="--speculative-method mtp.*no multi-token-prediction layer"):
        check_mtp(plain)


def test_make_tiny_model_refuses_mtp_for_a_family_without_one(tmp_path):
    with pytest.raises(ValueError, match="--mtp"):
        make_tiny_model(tmp_path / "m", "qwen3_moe", mtp=True)


def test_speculative_method_mtp_is_a_method():
    assert speculation_problems("mtp", 4) == []
    (problem,) = speculation_problems("eagle", 4)
    assert problem.startswith("--speculative-method must be one of off, ngram, mtp")


def test_qwen3_next_declares_and_loads_its_mtp_layer(tmp_path):
    model = make_tiny_model(tmp_path / "next", "qwen3_next", seed=0, mtp=True)
    spec = load_model_config(model)
    assert spec.mtp_draft_layers == 1
    head = MtpHead(spec, RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta), torch.float32)
    head.load_weights(read_mtp_tensors(model, spec))
    tensors = random_mtp_tensors(spec, seed=1)
    hidden, embeds, positions = _inputs(spec)
    torch.testing.assert_close(
        _head(spec, tensors)(hidden, embeds, positions).double(),
        reference_mtp(spec, tensors, hidden, embeds, positions),
        rtol=1e-4,
        atol=1e-4,
    )


def test_dedicated_mtp_embeddings_are_refused_naming_the_field():
    spec = parse_model_config(dict(QWEN35_35B, mtp_use_dedicated_embeddings=True))
    with pytest.raises(ConfigError, match="mtp_use_dedicated_embeddings"):
        check_mtp(spec)


# ---- GLM-4.5's NextN layer, against transformers' own GLM decoder layer ----------------------------------------------


@pytest.fixture(scope="module")
def glm_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("glm_mtp") / "glm4_moe", "glm4_moe", seed=0, mtp=True)


def _glm_reference(model_dir, spec):
    """The NextN layer as transformers computes a GLM decoder layer: transformers' Glm4MoeDecoderLayer (as layer
    num_layers of the tiny config) holding the checkpoint's tensors of that layer, its experts stacked as its
    Glm4MoeExperts keeps them, all of them and nothing else (a strict load), and the NextN layer's own eh_proj,
    enorm, hnorm and shared_head.norm in transformers' RMSNorm and a matrix product."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeDecoderLayer,
        Glm4MoeRMSNorm,
        Glm4MoeRotaryEmbedding,
    )

    config = Glm4MoeConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    p = f"model.layers.{spec.num_layers}."
    with safe_open(model_dir / "mtp.safetensors", framework="pt") as f:
        tensors = {name.removeprefix(p): f.get_tensor(name) for name in f.keys()}
    own = {name: tensors.pop(name) for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight")}
    own["shared_head.norm.weight"] = tensors.pop("shared_head.norm.weight")
    e = range(spec.num_experts)
    x = "mlp.experts."
    tensors[x + "gate_up_proj"] = torch.stack(
        [torch.cat([tensors.pop(f"{x}{n}.gate_proj.weight"), tensors.pop(f"{x}{n}.up_proj.weight")]) for n in e]
    )
    tensors[x + "down_proj"] = torch.stack([tensors.pop(f"{x}{n}.down_proj.weight") for n in e])
    layer = Glm4MoeDecoderLayer(config, layer_idx=spec.num_layers).eval()
    layer.load_state_dict(tensors, strict=True)
    rotary = Glm4MoeRotaryEmbedding(config)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = Glm4MoeRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        norms[name].weight.data.copy_(own[f"{name}.weight"])

    def forward(hidden, embeds, positions):
        x = torch.cat([norms["enorm"](embeds), norms["hnorm"](hidden)], -1) @ own["eh_proj.weight"].T
        t = len(positions)
        mask = torch.full((t, t), float("-inf")).masked_fill(positions[None, :] <= positions[:, None], 0.0)
        rope = rotary(x[None], positions[None])
        out = layer(x[None], attention_mask=mask[None, None], position_ids=positions[None], position_embeddings=rope)
        return norms["shared_head.norm"](out[0])

    return forward


def test_glm_nextn_layer_computes_what_transformers_glm_layer_does(glm_model):
    """eh_proj(cat(enorm(embedding), hnorm(hidden))) through transformers' Glm4MoeDecoderLayer (q/k/v biases, half
    of each head rotated, the sigmoid router over expert groups with its correction bias, the ungated shared expert)
    and shared_head.norm: the head read from the checkpoint computes the same."""
    spec = load_model_config(glm_model)
    assert (spec.mtp_layers, spec.mtp_draft_layers) == (1, 1) and spec.router_scoring == "sigmoid"
    head = MtpHead(spec, RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta), torch.float32)
    head.load_weights(read_mtp_tensors(glm_model, spec))
    hidden, embeds, positions = _inputs(spec)
    with torch.no_grad():
        want = _glm_reference(glm_model, spec)(hidden, embeds, positions)
        got = head(hidden, embeds, positions)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the comparison catches a swapped input: the hidden state where the embedding goes
        assert (head(embeds, hidden, positions) - want).abs().max() > 1e-2


def test_glm_nextn_names_map_both_ways_and_skip_the_targets_copies(glm_model):
    """Every MTP tensor has one place in a GLM checkpoint and back; the NextN layer's copies of the embedding table
    and the head are not MTP tensors (the head uses the target's), nor is any decoder layer's tensor."""
    spec = load_model_config(glm_model)
    p = f"model.layers.{spec.num_layers}."
    names = {**mtp_resident_weight_shapes(spec), **mtp_expert_shapes(spec)}
    for name in names:
        assert mtp_name(spec, mtp_checkpoint_name(spec, name)) == name
    assert mtp_checkpoint_name(spec, "mtp.fc.weight") == p + "eh_proj.weight"
    assert mtp_checkpoint_name(spec, "mtp.layers.0.mlp.shared_expert.up_proj.weight") == (
        p + "mlp.shared_experts.up_proj.weight"
    )
    for other in (p + "embed_tokens.weight", p + "shared_head.head.weight", "model.layers.0.input_layernorm.weight"):
        assert mtp_name(spec, other) is None
    # the target reads none of the NextN layer's tensors and prices none
    plain = make_tiny_model(glm_model.parent / "glm_plain", "glm4_moe", seed=0)
    assert resident_weight_bytes_from_checkpoint(glm_model, "bfloat16", spec) == resident_weight_bytes_from_checkpoint(
        plain, "bfloat16", load_model_config(plain)
    )


def test_glm_45_air_mtp_is_priced_tensor_by_tensor():
    """GLM-4.5-Air's NextN layer in bf16: eh_proj [4096, 8192]; attention q [96 x 128, 4096] with its bias, k and v
    [8 x 128, 4096] with theirs, o [4096, 96 x 128]; the router [128, 4096] and its correction bias, kept in float32;
    the shared expert's three [1408, 4096]; 128 experts of three 4096 x 1408 projections; five norms of 4096."""
    spec = load_model_config(GLM_45_AIR)
    h, q, kv = 4096, 96 * 128, 8 * 128
    matrices = h * 2 * h + q * h + 2 * kv * h + h * q + 128 * h + 3 * 1408 * h
    experts = 128 * 3 * h * 1408
    vectors = [q * 2, kv * 2, kv * 2, 128 * 4, *(h * 2,) * 5]  # biases, the float32 correction bias, norms
    assert spec.mtp_draft_layers == 1
    assert mtp_resident_bytes(spec, "bfloat16") == (matrices + experts) * 2 + sum(
        round_up(n, ALLOC_GRANULE) for n in vectors
    )


@pytest.mark.parametrize("model", ["glm", "qwen3.5"])
def test_the_plan_prices_what_a_full_size_head_allocates(model):
    """The head built at full size (on the meta device: shapes and dtypes, no memory) takes what the plan prices,
    allocation by allocation: GLM-4.5's 160 experts make the float32 correction bias (640 B) two granules, where
    bf16 would be one."""
    if model == "glm":
        spec = parse_model_config(dict(json.loads((GLM_45_AIR / "config.json").read_text()), n_routed_experts=160))
    else:
        spec = parse_model_config(QWEN35_35B)
    rotary = RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta)
    head = MtpHead(spec, rotary, torch.bfloat16, device="meta")
    allocated = sum(round_up(p.nbytes, ALLOC_GRANULE) for p in head.parameters())
    assert allocated == mtp_resident_bytes(spec, "bfloat16")


def test_the_benchs_mtp_workloads_are_qwen36_with_its_mtp_layer():
    """bench/decode_suite.py's `*_mtp` workloads (bench/speculation_oracle.py's MTP runs) read Qwen3.5-35B-A3B's
    config, whose text model is Qwen3.6-35B-A3B's with the MTP layer's keys the stored Qwen3.6 copy lacks."""
    import dataclasses

    from bench.decode_suite import WORKLOADS

    mtp = {name: w for name, w in WORKLOADS.items() if name.endswith("_mtp")}
    assert mtp
    qwen36 = load_model_config(MODELS / "qwen3.6-35b-a3b")
    for name, (config, *_) in mtp.items():
        spec = load_model_config(config.parent)
        check_mtp(spec)
        assert dataclasses.replace(spec, mtp_draft_layers=0) == qwen36, name


@pytest.mark.parametrize("index", [False, True])
def test_a_config_that_does_not_count_its_mtp_layer_gets_the_checkpoints(tmp_path, index):
    """Qwen3-Next's published config.json has no num_nextn_predict_layers while its checkpoint holds an MTP layer
    under `mtp.` (vLLM then takes one): the spec counts the checkpoint's `mtp.layers.N.`, by the shards' headers or
    the index's names; a count the config gives, 0 too, stands."""
    model = make_tiny_model(tmp_path / "next", "qwen3_next", seed=0, mtp=True)
    config = json.loads((model / "config.json").read_text())
    del config["num_nextn_predict_layers"]
    (model / "config.json").write_text(json.dumps(config))
    if index:
        from safetensors import safe_open

        weight_map = {}
        for shard in model.glob("*.safetensors"):
            with safe_open(shard, framework="pt") as f:
                weight_map.update((name, shard.name) for name in f.keys())
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    spec = load_model_config(model)
    assert spec.mtp_draft_layers == 1
    check_mtp(spec)
    (model / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))
    assert load_model_config(model).mtp_draft_layers == 0
    plain = make_tiny_model(tmp_path / "plain", "qwen3_next", seed=0)
    plain_config = json.loads((plain / "config.json").read_text())
    plain_config.pop("num_nextn_predict_layers", None)
    (plain / "config.json").write_text(json.dumps(plain_config))
    assert load_model_config(plain).mtp_draft_layers == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_path_writes_the_kv_the_torch_path_does(mtp_model, spec, dtype, monkeypatch):
    """A decode graph's K/V write through the kernels a GPU runs (the interpreter) against the torch path: the same
    rows written, the same values (the dense GEMV sums in another order; bf16 rounds each step)."""
    from interpreted_triton import run_interpreted

    hidden, embeds, positions = _inputs(spec)
    slots = torch.tensor([9, 2, 14, 5, 0])  # 4 pages of 4: scattered, the rest stays NaN
    args = (str(mtp_model), dtype, hidden, embeds, positions, slots, 4, 4)
    want = mtp_head_entry.written_kv(*args, triton=False)
    monkeypatch.setenv("FERRY_TRITON_ON_CPU", "1")  # the child's dispatch sends CPU tensors to Triton
    (got,) = run_interpreted("tests.unit.kernels.mtp_head_entry", "written_kv", [(args, dict(triton=True))])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for w, g in zip(want, got):
        assert torch.equal(torch.isnan(g), torch.isnan(w)) and torch.isnan(w).sum() == w.numel() - 5 * w[0, 0].numel()
        torch.testing.assert_close(g.float().nan_to_num(), w.float().nan_to_num(), rtol=tol, atol=tol)
