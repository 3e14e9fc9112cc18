"""Quantized checkpoints (issue 21) on CPU: the published configs are read (and anything else refused when
the config is read, so `ferry plan` refuses it before a byte is loaded), the plan prices the format's
slots, the loader's dequantization is the formats' own (compressed-tensors' for its layout), and tiny
checkpoints in every layout generate what transformers generates on the dequantized weights, all
resident and offloaded; the deliberate mistakes of tests/quantized_models.py break that."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ferry.plan.model_config import parse_model_config
from ferry.shared.errors import ConfigError
from tests.conftest import TINY_ARCHS
from tests.quantized_models import (
    LAYOUT_FORMATS,
    LAYOUTS,
    corrupt,
    dequantize_module,
    dequantized_copy,
    quantize_tiny,
)
from tests.unit.test_generate_e2e import ferry_generate

QWEN36 = "tests/data/models/qwen3.6-35b-a3b/config.json"
QWEN3 = "tests/data/models/qwen3-30b-a3b/config.json"


def _config(path: str, quantization: dict | None = None) -> dict:
    raw = json.loads(open(path).read())
    if quantization is not None:
        raw["quantization_config"] = quantization
    return raw


MIXED = {
    "quant_method": "modelopt",
    "quant_algo": "MIXED_PRECISION",
    "kv_cache_quant_algo": "FP8",
    "quantized_layers": {
        "model.language_model.layers.0.linear_attn.in_proj_qkv": {"quant_algo": "FP8"},
        "model.language_model.layers.0.mlp.experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
        "model.language_model.layers.3.self_attn.q_proj": {"quant_algo": "FP8"},
        "lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
    },
    "exclude_modules": ["mtp*"],
}
CT = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "nvfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
        }
    },
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}
FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "mlp.gate", "linear_attn.in_proj_b", "linear_attn.in_proj_a"],
}


# gpt-oss's quantization_config, as published
GPT_OSS_MXFP4 = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


@pytest.mark.parametrize(
    "config, quantization, want",
    [
        (
            QWEN36,
            {
                "quant_method": "modelopt",
                "quant_algo": "NVFP4",
                "group_size": 16,
                "ignore": ["lm_head", "model.language_model.layers.0.linear_attn*"],
            },
            "nvfp4",
        ),
        (QWEN36, MIXED, "nvfp4"),
        (QWEN36, CT, "nvfp4"),
        (QWEN36, FP8, "fp8-block"),
        (QWEN3, FP8, "fp8-block"),
        (QWEN3, {**FP8, "modules_to_not_convert": ["mlp.experts"]}, None),  # experts kept bf16
        (QWEN3, {"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["*mlp.experts*"]}, None),
        (QWEN3, GPT_OSS_MXFP4, "mxfp4"),
        (QWEN3, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.experts"]}, None),
        (QWEN3, {"quant_method": "mxfp4", "modules_to_not_convert": ["mlp.experts"]}, None),
    ],
)
def test_published_quantization_configs_give_the_expert_format(config, quantization, want):
    spec = parse_model_config(_config(config, quantization))
    assert spec.quantization is not None and spec.quantization.expert_format == want


@pytest.mark.parametrize(
    "quantization, group", [(GPT_OSS_MXFP4, 32), ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, 16)]
)
def test_expert_sizes_that_the_formats_groups_do_not_tile_are_a_config_error(quantization, group):
    raw = _config(QWEN3, quantization)
    raw["moe_intermediate_size"] = 768 + group // 2
    with pytest.raises(ConfigError, match=f"moe_intermediate_size: .* a multiple of {group}"):
        parse_model_config(raw)


def test_hf_quant_config_json_is_read_beside_the_config(tmp_path):
    from ferry.plan.model_config import load_model_config

    (tmp_path / "config.json").write_text(json.dumps(_config(QWEN3)))
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps(
            {
                "producer": {"name": "modelopt"},
                "quantization": {
                    "quant_algo": "NVFP4",
                    "group_size": 16,
                    "exclude_modules": ["lm_head", "model.layers.0.mlp.gate"],
                },
            }
        )
    )
    spec = load_model_config(tmp_path)
    assert spec.quantization.expert_format == "nvfp4" and spec.quantization.source == "hf_quant_config.json"


@pytest.mark.parametrize(
    "quantization, names",
    [
        ({"quant_method": "awq", "bits": 4}, ["'awq'"]),
        ({"quant_method": "gptq", "bits": 4}, ["'gptq'"]),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["'bitsandbytes'"]),
        ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, ["'W4A8_AWQ'"]),
        ({**FP8, "weight_block_size": [64, 64]}, ["[64, 64]"]),
        (
            {**CT, "format": "pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
            ["'pack-quantized'"],
        ),
    ],
)
def test_unsupported_quantization_is_refused_by_ferry_plan_before_anything_loads(tmp_path, capsys, quantization, names):
    from ferry.services.cli import main

    (tmp_path / "config.json").write_text(json.dumps(_config(QWEN3, quantization)))
    assert main(["plan", str(tmp_path), "--gpu-memory", "24GiB", "--host-memory", "100GiB"]) == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names) and "Ferry serves modelopt" in err and "fp8" in err, err
    with pytest.raises(ConfigError):
        parse_model_config(_config(QWEN3, quantization))


@pytest.mark.parametrize(
    "config, quantization, per_slot, gpu",
    [
        # 35B NVFP4: w13 = 1024 x 2048 codes (1 MiB) + scales (128 KiB) + 1024 fp32; w2 = 2048 x 512 likewise
        (QWEN36, MIXED, (1024 * 1024 + 1024 * 128 + 4 * 1024) + (2048 * 256 + 2048 * 32 + 4 * 2048), "24GiB"),
        # 30B FP8: w13 = 1536 x 2048 + 12 x 16 fp32 block scales; w2 = 2048 x 768 + 16 x 6 (each part 16-byte aligned)
        (QWEN3, FP8, (1536 * 2048 + 12 * 16 * 4) + (2048 * 768 + 16 * 6 * 4), "24GiB"),
        # 35B MXFP4: w13 = 1024 x 2048 codes (two a byte) + an e8m0 byte per 32; w2 = 2048 x 512 likewise
        # (its dense weights stay bf16, its experts fit 24 GiB: a smaller card offloads)
        (QWEN36, GPT_OSS_MXFP4, (1024 * 1024 + 1024 * 64) + (2048 * 256 + 2048 * 16), "16GiB"),
    ],
)
def test_ferry_plan_prices_the_quantized_slots_and_banks(tmp_path, capsys, config, quantization, per_slot, gpu):
    from ferry.services.cli import main

    (tmp_path / "config.json").write_text(json.dumps(_config(config, quantization)))
    assert main(["plan", str(tmp_path), "--gpu-memory", gpu, "--host-memory", "200GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    experts = plan["experts"]
    assert experts["bytes_per_slot"] == per_slot and experts["format"] in ("nvfp4", "fp8-block", "mxfp4")
    assert experts["slots"] < experts["total"]  # offloads on that card
    assert plan["host"]["expert_bank_bytes"] == experts["total"] * per_slot
    assert main(["plan", str(tmp_path), "--gpu-memory", gpu, "--host-memory", "200GiB"]) == 0
    table = capsys.readouterr().out
    assert f"{per_slot} B/slot, {experts['format']}" in table and f"in {experts['format']}" in table


def test_packed_banks_are_refused_for_quantized_experts(tmp_path, capsys):
    from ferry.services.cli import main

    (tmp_path / "config.json").write_text(json.dumps(_config(QWEN3, FP8)))
    assert (
        main(
            [
                "plan",
                str(tmp_path),
                "--gpu-memory",
                "24GiB",
                "--host-memory",
                "200GiB",
                "--expert-bank-format",
                "packed",
            ]
        )
        == 2
    )
    assert "--expert-bank-format packed keeps bf16 experts" in capsys.readouterr().err


# ---- the loader's dequantization against the formats' definitions ----------------------------------


def _nvfp4_parts(o: int, n: int) -> dict[str, torch.Tensor]:
    from ferry.services.worker.expert_formats.nvfp4 import quantize_linear as quantize_nvfp4

    torch.manual_seed(1)
    return quantize_nvfp4(torch.randn(o, n) * 0.05)


def test_nvfp4_dequantization_is_modelopts_and_the_nibble_order_that_of_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    from ferry.services.worker.quantized_weight import quantized_weight

    parts = _nvfp4_parts(96, 272)
    ours = quantized_weight("m", parts).dequantize(torch.float32)
    assert torch.equal(ours, dequantize_module(parts))
    codes = unpack_fp4_from_uint8(parts["weight"], 96, 272, torch.float32)  # compressed-tensors' own unpacking
    assert torch.equal(ours, codes * parts["weight_scale"].float().repeat_interleave(16, 1) * parts["weight_scale_2"])
    swapped = dict(parts, weight=(parts["weight"] >> 4) | ((parts["weight"] & 15) << 4))
    assert not torch.allclose(quantized_weight("m", swapped).dequantize(torch.float32), ours, atol=1e-3)


def test_compressed_tensors_nvfp4_dequantizes_as_compressed_tensors_decompresses():
    from ferry.services.worker.quantized_weight import quantized_weight
    from tests.quantized_models import _ct_nvfp4

    torch.manual_seed(2)
    w = torch.randn(64, 128) * 0.03
    parts = {
        k.removeprefix("l.mlp.experts.0.up_proj."): v
        for k, v in _ct_nvfp4({"l.mlp.experts.0.up_proj.weight": w})[0].items()
    }
    ours = quantized_weight("m", parts).dequantize(torch.float32)
    theirs = dequantize_module(parts)  # compressed-tensors' decompress (it returns bf16)
    assert (ours - theirs).abs().max() <= 2**-8 * theirs.abs().max()
    divided = dict(parts, weight_global_scale=1.0 / parts["weight_global_scale"])
    assert (quantized_weight("m", divided).dequantize(torch.float32) - theirs).abs().max() > 0.5 * theirs.abs().max()


def test_fp8_block_dequantization_with_partial_blocks_and_a_wrong_block_layout_caught():
    from ferry.services.worker.expert_formats.fp8_block import quantize_linear as quantize_fp8_block
    from ferry.services.worker.quantized_weight import quantized_weight

    torch.manual_seed(3)
    w = torch.randn(300, 200) * torch.linspace(0.01, 1, 300)[:, None]  # rows of very different scales
    parts = quantize_fp8_block(w)
    assert parts["weight_scale_inv"].shape == (3, 2)
    ours = quantized_weight("m", parts).dequantize(torch.float32)
    assert torch.equal(ours, dequantize_module(parts))
    assert (ours - w).abs().max() < 0.07 * w.abs().max()
    flipped = dict(parts, weight_scale_inv=parts["weight_scale_inv"].flip(0).contiguous())
    assert (quantized_weight("m", flipped).dequantize(torch.float32) - w).abs().max() > 0.3 * w.abs().max()


def test_mxfp4_dequantization_is_transformers_and_its_quantizer_never_clips():
    """The loader's mxfp4 linear dequantizes as transformers' gpt-oss dequantizer does (dequantize_module), the
    quantizer's scales hold every group's largest value (no code saturates past it), and the nibble order
    and the e8m0 bias matter."""
    from ferry.services.worker.expert_formats.mxfp4 import quantize_linear as quantize_mxfp4
    from ferry.services.worker.quantized_weight import quantized_weight

    torch.manual_seed(4)
    w = torch.randn(48, 320) * torch.linspace(0.001, 1, 48)[:, None]
    w[3, :32] = 0.0  # an all-zero group
    parts = quantize_mxfp4(w)
    assert parts["weight_blocks"].shape == (48, 10, 16) and parts["weight_scales"].shape == (48, 10)
    ours = quantized_weight("m", parts).dequantize(torch.float32)
    assert torch.equal(ours, dequantize_module(parts))
    groups, error = w.view(48, 10, 32), (ours - w).view(48, 10, 32).abs()
    scale = torch.exp2(parts["weight_scales"].float() - 127)
    assert (error <= scale[..., None]).all()  # within a step of e2m1's widest (2 x scale, halved)
    assert (groups.abs().amax(-1) <= 6 * scale).all() and (groups.abs().amax(-1) > 3 * scale)[
        groups.amax(-1) != 0
    ].all()
    assert (ours[3, :32] == 0).all()
    blocks = parts["weight_blocks"]
    swapped = dict(parts, weight_blocks=(blocks >> 4) | ((blocks & 15) << 4))
    assert not torch.allclose(quantized_weight("m", swapped).dequantize(torch.float32), ours, atol=1e-3)
    biased = dict(parts, weight_scales=parts["weight_scales"] + 1)
    assert torch.equal(quantized_weight("m", biased).dequantize(torch.float32), 2 * ours)


def test_an_mxfp4_module_with_wrong_scales_is_a_clear_error():
    from ferry.services.worker.expert_formats.mxfp4 import quantize_linear as quantize_mxfp4
    from ferry.services.worker.quantized_weight import QuantizedWeightError, quantized_weight

    parts = quantize_mxfp4(torch.randn(16, 64))
    with pytest.raises(QuantizedWeightError, match="needs weight_scales"):
        quantized_weight("layers.0.mlp.experts.0.up_proj", {"weight_blocks": parts["weight_blocks"]})
    with pytest.raises(QuantizedWeightError, match=r"weight_scales is torch.uint8 \(16, 1\)"):
        quantized_weight("m", dict(parts, weight_scales=parts["weight_scales"][:, :1]))


def test_a_quantized_module_missing_its_scale_is_a_clear_error():
    from ferry.services.worker.quantized_weight import QuantizedWeightError, quantized_weight

    parts = _nvfp4_parts(16, 32)
    with pytest.raises(QuantizedWeightError, match="weight_scale_2"):
        quantized_weight(
            "layers.0.mlp.experts.0.up_proj", {"weight": parts["weight"], "weight_scale": parts["weight_scale"]}
        )


# ---- tiny checkpoints against transformers on the dequantized weights ----------------------------------

PROMPT = ",".join(str((i * 37 + 11) % 200) for i in range(40))
ARGS = ("--prompt-ids", PROMPT, "--max-tokens", "8", "--ignore-eos", "--dtype", "float32", "--temperature", "0")
# nvfp4 is W4A16 and fp8 W8A16 here: activations stay float32, so both are held to the tighter bound
TOLERANCE = 0.05


def _hf_greedy_logprobs(model_dir, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probability of each generated token given what precedes it (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), dim=-1)
    return [float(lp[len(prompt) - 1 + j, t]) for j, t in enumerate(tokens)]


def _worst(got: dict, reference_dir) -> float:
    prompt = [int(i) for i in PROMPT.split(",")]
    want = _hf_greedy_logprobs(reference_dir, prompt, got["token_ids"])
    return max(abs(a - b) for a, b in zip(got["logprobs"], want))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_quantized_tiny_checkpoints_generate_as_transformers_on_the_dequantized_weights(
    quantized_tiny_models, tmp_path, capsys, arch, layout
):
    model = quantized_tiny_models(arch, layout)
    reference = dequantized_copy(model, tmp_path / "dequantized")
    resident = ferry_generate(capsys, model, *ARGS)
    assert resident["plan"]["experts"]["format"] == LAYOUT_FORMATS[layout]
    assert resident["expert_cache"]["expert_format"] == resident["plan"]["experts"]["format"]
    assert _worst(resident, reference) < TOLERANCE
    offloaded = ferry_generate(capsys, model, *ARGS, "--moe-cache-size", "9")
    assert offloaded["token_ids"] == resident["token_ids"] and offloaded["logprobs"] == resident["logprobs"]
    cache = offloaded["expert_cache"]
    assert (
        cache["misses"] > 0
        and cache["bytes_copied"] == cache["misses"] * offloaded["plan"]["experts"]["bytes_per_slot"]
    )


def test_a_glm_nvfp4_checkpoint_with_its_dense_mlp_and_shared_experts_quantized_generates_as_transformers(
    tmp_path, capsys
):
    """GLM-4 MoE in the NVFP4 layout FreeToken 0.1.2 reads (the dense layer's MLP and the shared experts NVFP4 too,
    the router bf16): the dense linears are dequantized at load, priced at the run dtype as the bf16 checkpoint's
    are, and the model generates as transformers on the dequantized weights, resident and offloaded."""
    from ferry.services.make_tiny_model import make_tiny_model

    source = make_tiny_model(tmp_path / "glm", "glm4_moe", seed=0)
    model = quantize_tiny(source, tmp_path / "nvfp4", "modelopt-nvfp4")
    names = load_file(str(model / "model.safetensors"))
    assert {
        "model.layers.0.mlp.gate_proj.weight_scale",
        "model.layers.1.mlp.shared_experts.up_proj.weight_scale",
    } <= set(names) and "model.layers.1.mlp.gate.weight_scale" not in names
    reference = dequantized_copy(model, tmp_path / "dequantized")
    resident = ferry_generate(capsys, model, *ARGS)
    plain = ferry_generate(capsys, source, *ARGS)
    assert resident["plan"]["weights_bytes"] == plain["plan"]["weights_bytes"]
    assert _worst(resident, reference) < TOLERANCE
    offloaded = ferry_generate(capsys, model, *ARGS, "--moe-cache-size", "9")
    assert offloaded["expert_cache"]["misses"] > 0
    assert offloaded["token_ids"] == resident["token_ids"] and offloaded["logprobs"] == resident["logprobs"]


@pytest.mark.parametrize(
    "layout, mistake",
    [
        ("modelopt-nvfp4", "nibbles"),
        ("modelopt-nvfp4", "scale"),
        ("ct-nvfp4", "nibbles"),
        ("ct-nvfp4", "scale"),
        ("fp8", "scale"),
        ("mxfp4", "nibbles"),
        ("mxfp4", "scale"),
    ],
)
def test_a_wrong_nibble_order_or_scale_convention_fails_the_comparison(
    quantized_tiny_models, tmp_path, capsys, layout, mistake
):
    model = quantized_tiny_models("qwen3_moe", layout)
    reference = dequantized_copy(model, tmp_path / "dequantized")
    wrong = corrupt(model, tmp_path / "wrong", mistake)
    assert _worst(ferry_generate(capsys, wrong, *ARGS), reference) > TOLERANCE


@pytest.mark.parametrize("layout", ["modelopt-nvfp4", "fp8", "mxfp4"])
def test_dummy_weights_in_a_quantized_format_all_resident_and_offloaded(quantized_tiny_models, capsys, layout):
    model = quantized_tiny_models("qwen3_5_moe", layout)
    for extra in ((), ("--moe-cache-size", "9")):
        got = ferry_generate(capsys, model, *ARGS, "--load-format", "dummy", *extra)
        assert len(got["token_ids"]) == 8 and all(lp <= 0 for lp in got["logprobs"])
        assert got["plan"]["experts"]["format"] == LAYOUT_FORMATS[layout]
