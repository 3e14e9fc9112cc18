"""A Hugging Face checkpoint of attention and MoE layers (qwen3_moe, qwen3_5_moe, qwen3_next, glm4_moe, gpt_oss,
gemma4: the families with a GGUF architecture, each one's own keys (and generated tensors) by its family module's
`gguf_write_metadata`, where it fuses its experts `gguf_split_experts`, and where the converter changes values
`gguf_write_tensor`) rewritten
as a GGUF file, by the gguf package's own writer (`gguf.GGUFWriter`), as llama.cpp's converter lays one out:
llama.cpp's metadata keys, its tensor names (the gguf package's table), the tokenizer's vocabulary, merges,
token types, special ids and chat template.

The routed experts are written in one ggml type (`expert_type`): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 quantized
from the checkpoint's weights by the gguf package itself (`gguf.quants.quantize`); the K and IQ4 types (Q4_K, Q5_K,
Q6_K, IQ4_NL, IQ4_XS), which that package can only decode, as random but valid blocks whose values have the
checkpoint's experts' spread. Or in llama.cpp's Q4_K_M / Q5_K_M mix (`EXPERT_MIXES`): gate and up Q4_K (Q5_K),
down Q6_K on the layers llama-quantize gives more bits (`more_bits`) and Q4_K (Q5_K) on the others. Dense matrices
are written F16 (their norms and routers F32, as llama.cpp keeps them), so loading dequantizes them. The tests' tiny
GGUF models come from here (`ferry make-tiny-model --gguf TYPE`); the model a GGUF file is held to is the file
itself, decoded by the gguf package (tests/unit/test_gguf_checkpoints.py). A benchmark's model of real shapes
(`ferry make-bench-model --format gguf-TYPE`) gives its dense tensors in memory and has every type's routed experts
drawn as random valid blocks (`random_experts`): no expert weight is drawn or quantized. No torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ferry.plan.gguf_checkpoint import EXPERT_PARTS, GgufNames, mtp_gguf_source
from ferry.plan.model_config import parse_model_config
from ferry.plan.model_families import family_for_config
from ferry.plan.mtp_layer import mtp_name

# (byte offset, value for weights of std 1) of each fp16 scale of a block whose other bytes are random
# (kernels/gguf_blocks.py has the layouts; the spreads are those of random codes under random scales; the worker's
# dummy experts use the same, services/worker/expert_formats/gguf_*.py's `scale_fields`)
_RANDOM_BLOCK_SCALES = {
    "Q8_0": ((0, 1 / 73.9),),
    "Q4_0": ((0, 1 / 4.6),),
    "Q4_1": ((0, 1 / 4.6), (2, -7.5 / 4.6)),
    "Q5_0": ((0, 1 / 9.2),),
    "Q5_1": ((0, 1 / 9.2), (2, -15.5 / 9.2)),
    "Q4_K": ((0, 1 / 258.3), (2, 7.5 / 258.3)),
    "Q5_K": ((0, 1 / 527.0), (2, 15.5 / 527.0)),
    "Q6_K": ((208, 1 / 1369.0),),
    "IQ4_NL": ((0, 1 / 67.4),),
    "IQ4_XS": ((0, 1 / 1246.0),),
}
# MXFP4's random blocks: e2m1 codes at random have a std of ~2.93; the e8m0 byte e scales them by 2^(e - 127)
_MXFP4_CODE_STD, _E8M0_BIAS = 2.93, 127
# the types the gguf package quantizes itself (from the checkpoint's weights), then the K types it only decodes
QUANTIZED_BY_GGUF = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
# float32 experts (llama.cpp writes gpt-oss's so when asked for F32; ggml-org's files hold MXFP4)
FLOAT_EXPERT_TYPES = ("F32",)
# llama.cpp's _M mixes, for the routed experts: (gate and up's type everywhere, down's on the layers that
# llama-quantize gives more bits, `more_bits`; down has the gate's type on the others)
EXPERT_MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}
EXPERT_TYPES = (*QUANTIZED_BY_GGUF, *(t for t in _RANDOM_BLOCK_SCALES if t not in QUANTIZED_BY_GGUF))
EXPERT_TYPES += (*FLOAT_EXPERT_TYPES, *EXPERT_MIXES)
# GGUF's K blocks hold 256 values: a tiny model written as GGUF has rows of whole blocks
GGUF_SIZES = dict(hidden_size=256, moe_intermediate_size=256)
_CONTROL, _NORMAL = 3, 1  # llama.cpp's token types


def write_gguf(
    hf_dir: str | Path,
    out: str | Path,
    expert_type: str = "Q8_0",
    seed: int = 0,
    split_max_tensors: int = 0,
    fused_gate_up: bool = False,
    tensors: dict[str, np.ndarray] | None = None,
    random_experts: tuple[float, float] | None = None,
    holes: bool = False,
) -> Path:
    """Write `hf_dir` (a checkpoint of one safetensors file or more) to the GGUF file `out`; with
    `split_max_tensors`, as a split set of files of at most that many tensors (`OUT-00001-of-0000N.gguf`...,
    the first of which is returned); with `fused_gate_up`, each layer's gate and up experts as one tensor
    (`ffn_gate_up_exps`, the gate's rows first), as llama.cpp's converter writes them when asked. `tensors`: the
    checkpoint's tensors by name, in place of hf_dir's shards (which then need hold only its config and tokenizer);
    `random_experts` (the gate and up experts' std, down's): the routed experts drawn as random valid blocks of
    `expert_type` of those spreads, their biases (where the family has them) zero, none read from the checkpoint;
    `holes` (with `random_experts`): no tensor's bytes written, the file's data a hole of its size (a sparse file,
    zeros when read): the whole tensor table of a full-size model in the disk a metadata takes, for `ferry plan`.
    `tensors` may then be views of no memory (`zeros`): only their shapes are read."""
    import gguf
    from safetensors.numpy import load_file

    if expert_type not in EXPERT_TYPES:
        raise ValueError(f"--gguf must be one of {', '.join(EXPERT_TYPES)}, got {expert_type!r}")
    if random_experts is not None and expert_type in FLOAT_EXPERT_TYPES:
        raise ValueError(f"random experts are blocks of a quantized type, not {expert_type}")
    if holes and random_experts is None:
        raise ValueError("a GGUF of holes draws no experts from a checkpoint: give random_experts")
    hf_dir, out = Path(hf_dir), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads((hf_dir / "config.json").read_text())
    family = family_for_config(config, str(hf_dir / "config.json"))
    if family.gguf_write_metadata is None:  # llama.cpp's converter writes a family's own keys: its module knows them
        raise ValueError(f"the GGUF writer takes no {family.name} checkpoint (its family has no gguf_write_metadata)")
    architecture = family.gguf_architectures[0]
    spec = parse_model_config(config, str(hf_dir / "config.json"))
    config = family.text_config(config, str(hf_dir / "config.json"))  # a multimodal wrapper's text model (Gemma 4's)
    if tensors is None:
        tensors = {}
        for shard in sorted(hf_dir.glob("*.safetensors")):
            tensors.update(load_file(shard))
    # the caller's dict is left whole (the experts are popped from this one); a wrapper's text tensors lose their
    # `language_model.`, as llama.cpp's converter drops it before its table lookup
    tensors = {name.replace(".language_model.", ".", 1): value for name, value in tensors.items()}
    layers = int(config["num_hidden_layers"])
    tensors, nextn_tensors, mtp_layers = _mtp_as_blocks(family, spec, config, tensors, layers)
    if family.mtp_config_key:  # the MTP layers the file holds, which its metadata counts
        config = {**config, family.mtp_config_key: mtp_layers}
    writer = gguf.GGUFWriter(str(out), architecture, split_max_tensors=split_max_tensors)

    def add(gguf_name: str, data: np.ndarray, ggml_type: str | None = None) -> None:
        raw = None if ggml_type is None or ggml_type in FLOAT_EXPERT_TYPES else gguf.GGMLQuantizationType[ggml_type]
        if holes:  # its entry in the table, no bytes
            writer.add_tensor_info(gguf_name, data.shape, data.dtype, data.nbytes, raw_dtype=raw)
        else:
            writer.add_tensor(gguf_name, data, raw_dtype=raw)

    def cast(value: np.ndarray, dtype) -> np.ndarray:
        return zeros(value.shape, dtype) if holes else value.astype(dtype)

    family.gguf_write_metadata(writer, config)
    common_metadata(writer, config)
    _tokenizer(writer, hf_dir)
    names = GgufNames(architecture, layers + mtp_layers)
    rng = np.random.default_rng(seed)
    experts_of = family.gguf_split_experts or _per_expert
    for layer in (*spec.moe_layer_indices, *range(layers, layers + mtp_layers)):
        if random_experts is None:
            weights, biases = experts_of(tensors, layer, spec.num_experts)
        else:
            weights, biases = None, _zero_biases(spec) if spec.expert_bias else {}
        parts = {}  # part -> (values or blocks, ggml type)
        for part in EXPERT_PARTS:
            ggml_type = _part_type(expert_type, part, layer, layers)
            if weights is None:
                shape = _expert_shape(spec, part)
                std = random_experts[1] if part == "down_proj" else random_experts[0]
                blocks = _block_zeros(shape, ggml_type) if holes else random_blocks(shape, ggml_type, std, rng)
                parts[part] = (blocks, ggml_type)
            elif ggml_type in FLOAT_EXPERT_TYPES:
                parts[part] = (weights[part].astype(np.float32), ggml_type)
            else:
                parts[part] = (_expert_blocks(weights[part], ggml_type, rng), ggml_type)
        separate = names.experts(layer)
        written = {separate["down_proj"]: parts["down_proj"]}  # GGUF name -> (values or blocks, ggml type)
        # fused where asked, or where the family's table has only the fused tensor (Gemma 4's)
        if fused_gate_up or separate["gate_proj"] is None:
            fused = names.fused_gate_up(layer)
            if fused is None:
                raise ValueError(f"the gguf package's {architecture} table names no fused gate/up experts")
            (gate, ggml_type), (up, _) = parts["gate_proj"], parts["up_proj"]
            if holes:
                fused_blocks = zeros((gate.shape[0], gate.shape[1] + up.shape[1], *gate.shape[2:]), gate.dtype)
            else:
                fused_blocks = np.concatenate([gate, up], axis=1)
            written[fused] = (fused_blocks, ggml_type)
        else:
            written.update({separate[p]: parts[p] for p in ("gate_proj", "up_proj")})
        for gguf_name, (data, ggml_type) in written.items():
            add(gguf_name, data, ggml_type)
        for part, bias in biases.items():
            add(names.gguf_name(f"model.layers.{layer}.mlp.experts.{part}.bias"), cast(bias, np.float32))
    for checkpoint_name, checkpoint_value in sorted(tensors.items()):
        checkpoint_value = cast(checkpoint_value, np.float32)
        written = (
            {checkpoint_name: checkpoint_value}
            if family.gguf_write_tensor is None
            else family.gguf_write_tensor(spec, checkpoint_name, checkpoint_value)
        )
        for name, value in written.items():
            gguf_name = names.gguf_name(name)
            if gguf_name is None:
                raise ValueError(f"{name}: the gguf package's {architecture} table has no name for it")
            value = cast(np.asarray(value), np.float32)
            # llama.cpp keeps routers and the Gated DeltaNet's convolution float32, as norms
            kept = gguf_name.split(".")[-2] in ("ffn_gate_inp", "ffn_gate_inp_shexp", "ssm_conv1d")
            add(gguf_name, cast(value, np.float16) if value.ndim == 2 and not kept else value)
    for gguf_name, (checkpoint_name, value) in nextn_tensors.items():  # the MTP layer's `nextn.` tensors
        if family.gguf_write_tensor is not None:
            (value,) = family.gguf_write_tensor(spec, checkpoint_name, value).values()
        add(gguf_name, cast(np.asarray(value), np.float16 if value.ndim == 2 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    if holes:  # the data section's size, past its alignment: truncate extends a file by a hole
        writer.write_ti_data_to_file()
        for fout, listed in zip(writer.fout, writer.tensors):
            writer.write_padding(fout, fout.tell())
            fout.truncate(
                fout.tell() + sum(writer.ggml_pad(ti.nbytes, writer.data_alignment) for ti in listed.values())
            )
    else:
        writer.write_tensors_to_file()
    writer.close()
    return out if not split_max_tensors else sorted(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))[0]


def _mtp_as_blocks(family, spec, config: dict, tensors: dict, layers: int) -> tuple[dict, dict, int]:
    """(the checkpoint's tensors with its MTP ones as llama.cpp's converter writes them, {GGUF name: (MTP name,
    values)} of those it names itself (`nextn.`), the MTP layers written): the MTP layers (wherever the family's
    checkpoints store them: plan/mtp_layer.py's `mtp_name`) become decoder blocks `layers + i`
    (plan/gguf_checkpoint.py's `mtp_gguf_source`) where the family's converter writes them (`ModelFamily.gguf_mtp`),
    and are dropped where it does not."""
    mtp = {name: mtp_name(spec, name) for name in tensors}
    mtp = {name: canonical for name, canonical in mtp.items() if canonical is not None}
    rest = {name: value for name, value in tensors.items() if name not in mtp}
    if not mtp or not family.gguf_mtp:
        return rest, {}, 0
    nextn = {}
    for name, canonical in mtp.items():
        kind, target = mtp_gguf_source(canonical, layers)
        if kind == "gguf":
            nextn[target] = (canonical, tensors[name].astype(np.float32))
        else:
            rest[target] = tensors[name]
    return rest, nextn, int(config.get(family.mtp_config_key) or 0)


def more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's `use_more_bits`: the layers whose ffn_down an _M mix gives the larger type (the first and
    last eighth of the blocks, and every third between)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _part_type(expert_type: str, part: str, layer: int, layers: int) -> str:
    """The ggml type of layer `layer`'s routed `part` (gate_proj, up_proj, down_proj) for --gguf `expert_type`: the
    type itself, or for a mix (EXPERT_MIXES) its down type on the `more_bits` layers and its base type elsewhere.
    As llama-quantize does for a MoE model: the layer is the block's index (from the tensor's name), counted out of
    the block count (its n_ffn_down = n_layer)."""
    if expert_type not in EXPERT_MIXES:
        return expert_type
    base, more = EXPERT_MIXES[expert_type]
    return more if part == "down_proj" and more_bits(layer, layers) else base


def common_metadata(writer, config: dict) -> None:
    """The keys llama.cpp's converter writes for every family (TextModel.set_gguf_parameters), but those the family's
    own `gguf_write_metadata` wrote before (where the converter writes a key twice, its family's value stands)."""
    import gguf

    keys, written = gguf.Keys, writer.kv_data[0]

    def put(key: str, add, value) -> None:
        if key.format(arch=writer.arch) not in written:
            add(value)

    rope = config.get("rope_parameters") or {}
    put(keys.LLM.CONTEXT_LENGTH, writer.add_context_length, config["max_position_embeddings"])
    put(keys.LLM.EMBEDDING_LENGTH, writer.add_embedding_length, config["hidden_size"])
    if "intermediate_size" in config:  # a model of MoE layers alone may have none (Qwen3.5's)
        put(keys.LLM.FEED_FORWARD_LENGTH, writer.add_feed_forward_length, config["intermediate_size"])
    put(keys.Attention.HEAD_COUNT, writer.add_head_count, config["num_attention_heads"])
    put(keys.Attention.HEAD_COUNT_KV, writer.add_head_count_kv, config["num_key_value_heads"])
    put(keys.Attention.KEY_LENGTH, writer.add_key_length, config["head_dim"])
    put(keys.Attention.VALUE_LENGTH, writer.add_value_length, config["head_dim"])
    theta = float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    put(keys.Rope.FREQ_BASE, writer.add_rope_freq_base, theta)
    put(keys.Attention.LAYERNORM_RMS_EPS, writer.add_layer_norm_rms_eps, config["rms_norm_eps"])
    experts = int(config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"])
    put(keys.LLM.EXPERT_COUNT, writer.add_expert_count, experts)
    used = config.get("num_experts_per_tok") or config["top_k_experts"]
    put(keys.LLM.EXPERT_USED_COUNT, writer.add_expert_used_count, used)


def _per_expert(tensors: dict, layer: int, experts: int) -> tuple[dict, dict]:
    """({part: [E, rows, cols]} float32, {}) of a checkpoint storing each expert's linears apart (popped)."""
    prefix = f"model.layers.{layer}.mlp.experts"
    weights = {
        part: np.stack([tensors.pop(f"{prefix}.{e}.{part}.weight") for e in range(experts)]).astype(np.float32)
        for part in ("gate_proj", "up_proj", "down_proj")
    }
    return weights, {}


def _tokenizer(writer, hf_dir: Path) -> None:
    """The byte-level BPE of tokenizer.json as llama.cpp stores a gpt2-type vocabulary (tokens in the byte
    alphabet's spelling, merges as "a b"), its pre-tokenizer named by the Qwen3.5 split it uses."""
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    tokens = [None] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(spec))
    writer.add_token_list(tokens)
    writer.add_token_types([_CONTROL if t in special else _NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    gen = (
        json.loads((hf_dir / "generation_config.json").read_text())
        if (hf_dir / "generation_config.json").is_file()
        else {}
    )
    eos = gen.get("eos_token_id", special.get(config.get("eos_token")))
    writer.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if config.get("pad_token") in special:
        writer.add_pad_token_id(special[config["pad_token"]])
    writer.add_add_bos_token(False)
    template = hf_dir / "chat_template.jinja"
    template = template.read_text() if template.is_file() else config.get("chat_template")
    if template is not None:  # gpt-oss's tokenizer has none: its chat format is harmony (openai-harmony)
        writer.add_chat_template(template)


def _pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) of tokenizer.json's split: the first of transformers' GGUF names for
    that regex (the reader maps the name back to it), so the file's tokenizer splits text as the original does."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    pre = spec.get("pre_tokenizer") or {}
    patterns = [p["pattern"].get("Regex") for p in pre.get("pretokenizers", [pre]) if p.get("type") == "Split"]
    for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items():
        if regex in patterns:
            return name
    raise ValueError(f"no GGUF pre-tokenizer name has tokenizer.json's split {patterns!r}")


def _expert_blocks(weights: np.ndarray, expert_type: str, rng: np.random.Generator) -> np.ndarray:
    """[E, rows, cols] float32 -> [E, rows, row bytes] uint8 blocks of `expert_type`: quantized by the gguf
    package where it can, else random blocks of the weights' spread."""
    import gguf

    if expert_type in QUANTIZED_BY_GGUF:
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType[expert_type])
    return random_blocks(weights.shape, expert_type, float(weights.std()), rng)


def random_blocks(shape: tuple[int, ...], expert_type: str, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks of `expert_type` for values of `shape` (its last a whole number of blocks), uint8
    [..., row bytes]: random bytes (every code a value), every block's scales set so the values have about `std`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[expert_type]
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(tuple(shape), qtype), dtype=np.uint8)
    view = blocks.reshape(-1, size)
    if expert_type == "MXFP4":  # one e8m0 byte a block, not an fp16
        view[:, 0] = _E8M0_BIAS + round(float(np.log2(std / _MXFP4_CODE_STD)))
        return blocks
    for offset, unit in _RANDOM_BLOCK_SCALES[expert_type]:
        view[:, offset : offset + 2] = np.frombuffer(np.float16(std * unit).tobytes(), dtype=np.uint8)
    return blocks


def zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A read-only array of zeros of `shape` that takes no memory (one element, broadcast): a tensor of a GGUF of
    holes, whose shape alone is written."""
    return np.broadcast_to(np.zeros((), dtype=dtype), tuple(shape))


def _block_zeros(shape: tuple[int, ...], expert_type: str) -> np.ndarray:
    """`zeros` of the uint8 block bytes `random_blocks` would draw for values of `shape`."""
    import gguf

    return zeros(gguf.quants.quant_shape_to_byte_shape(tuple(shape), gguf.GGMLQuantizationType[expert_type]), np.uint8)


def _expert_shape(spec, part: str) -> tuple[int, int, int]:
    """[E, rows, cols] of a layer's routed `part` (gate_proj and up_proj [E, I, H], down_proj [E, H, I])."""
    h, i = spec.hidden_size, spec.moe_intermediate_size
    return (spec.num_experts, h, i) if part == "down_proj" else (spec.num_experts, i, h)


def _zero_biases(spec) -> dict[str, np.ndarray]:
    """A layer's routed experts' biases, zero (the dummy recipe's), by part: [E, rows] float32."""
    return {part: np.zeros(_expert_shape(spec, part)[:2], dtype=np.float32) for part in EXPERT_PARTS}
