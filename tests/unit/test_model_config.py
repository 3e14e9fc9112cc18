import copy
import json

import pytest

from ferry.plan.model_config import FULL_ATTENTION, LINEAR_ATTENTION, load_model_config, parse_model_config
from ferry.shared.errors import ConfigError
from tests.helpers import QWEN3_6_35B, QWEN3_30B


def _raw(path):
    return json.loads((path / "config.json").read_text())


def test_qwen3_moe_published_config():
    spec = load_model_config(QWEN3_30B)
    assert spec.arch == "qwen3_moe"
    assert spec.layer_types == (FULL_ATTENTION,) * 48
    assert spec.moe_layer_indices == tuple(range(48))
    assert (spec.num_experts, spec.num_experts_per_tok, spec.total_experts) == (128, 8, 6144)
    assert (spec.num_kv_heads, spec.head_dim, spec.partial_rotary_factor) == (4, 128, 1.0)
    assert not spec.zero_centered_norms and spec.shared_expert_intermediate_size == 0


def test_qwen3_5_moe_multimodal_wrapper_reads_text_config():
    spec = load_model_config(QWEN3_6_35B)
    assert spec.arch == "qwen3_5_moe" and spec.text_config["model_type"] == "qwen3_5_moe_text"
    assert spec.full_attention_layers == tuple(range(3, 40, 4))
    assert len(spec.linear_attention_layers) == 30
    assert spec.linear_conv_dim == 2 * 16 * 128 + 32 * 128
    assert spec.partial_rotary_factor == 0.25 and spec.rope_theta == 10_000_000
    assert spec.shared_expert_intermediate_size == 512 and spec.attn_output_gate


def test_flat_text_config_and_full_attention_interval_agree_with_layer_types():
    raw = _raw(QWEN3_6_35B)["text_config"]
    flat = parse_model_config(raw)
    no_types = copy.deepcopy(raw)
    del no_types["layer_types"]
    assert parse_model_config(no_types).layer_types == flat.layer_types
    assert flat == load_model_config(QWEN3_6_35B)


def test_num_local_experts_spelling():
    raw = _raw(QWEN3_30B)
    raw["num_local_experts"] = raw.pop("num_experts")
    assert parse_model_config(raw).num_experts == 128


def test_qwen3_next_mlp_only_layers_and_sparse_step():
    raw = _raw(QWEN3_6_35B)["text_config"] | {
        "model_type": "qwen3_next",
        "mlp_only_layers": [0],
        "decoder_sparse_step": 2,
        "intermediate_size": 1024,
    }
    spec = parse_model_config(raw)
    assert spec.arch == "qwen3_next"
    assert not spec.moe_layers[0] and not spec.moe_layers[2] and spec.moe_layers[1] and spec.moe_layers[3]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok (200)"),
        ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
    ],
)
def test_bad_configs_get_clear_errors(change, message):
    raw = _raw(QWEN3_30B) | change
    with pytest.raises(ConfigError) as err:
        parse_model_config(raw)
    assert message in str(err.value)


def test_layer_types_length_mismatch():
    raw = copy.deepcopy(_raw(QWEN3_6_35B))
    raw["text_config"]["layer_types"] = [LINEAR_ATTENTION, FULL_ATTENTION]
    with pytest.raises(ConfigError, match="layer_types has 2 entries but num_hidden_layers is 40"):
        parse_model_config(raw)


def test_missing_config_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--model"):
        load_model_config(tmp_path)
