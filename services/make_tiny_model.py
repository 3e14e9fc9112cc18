"""`ferry make-tiny-model DIR --arch NAME [--seed N]`: the demo model and the tests' fixture.

Every family with a `tiny_config` (plan/model_families/) has one; transformers' classes it names write it.

A small random-weight checkpoint in the exact layout of a real one (config.json, safetensors,
tokenizer files, generation_config.json), written by transformers itself so the reference
implementation loads it unchanged. The weights are a pure function of the seed: the same seed
gives byte-identical safetensors."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ferry.plan.model_families import families
from ferry.services.gguf_writer import EXPERT_TYPES, GGUF_SIZES, write_gguf

# Small enough to build and run in well under a second on CPU, big enough that every code path
# is real: GQA (4 query heads over 2 KV heads), several experts with top-2 routing; each family's
# `tiny_config` (plan/model_families/) adds its own fields (the hybrid: both layer kinds, more value
# heads than key heads).
COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # A wider init than 0.02 makes the random model's next-token distribution peaked enough
    # that greedy decoding is not decided by rounding noise.
    initializer_range=0.08,
)
TINY_FAMILIES = {name: f for name, f in families().items() if f.tiny_config is not None}
ARCHS = tuple(sorted(TINY_FAMILIES))
TINY_CONFIGS = {name: dict(COMMON, **f.tiny_config) for name, f in TINY_FAMILIES.items()}
# the families with a multi-token-prediction layer: the config.json key that counts it (`--mtp` writes one)
MTP_CONFIG_KEYS = {name: f.mtp_config_key for name, f in TINY_FAMILIES.items() if f.mtp_config_key}


def make_tiny_model(out_dir: str | Path, arch: str, seed: int = 0, mtp: bool = False, **sizes: int) -> Path:
    """Write the checkpoint into `out_dir` (created if needed) and return it; `sizes` replace the tiny
    config's (e.g. hidden_size, moe_intermediate_size: GGUF's K blocks need rows of 256 values). `mtp`: also
    one multi-token-prediction layer (random tensors in mtp.safetensors, named as the family's checkpoints name
    them: plan/mtp_layer.py; transformers does not read them), and its count in config.json."""
    from ferry.shared.file_modes import written_with_umask_modes

    if arch not in TINY_CONFIGS:
        raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if mtp and arch not in MTP_CONFIG_KEYS:
        raise ValueError(f"--mtp: {arch} has no MTP layer; --arch must be one of {', '.join(MTP_CONFIG_KEYS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with written_with_umask_modes(out):  # readable by others under the usual umask: a container serves it
        _write(out, arch, seed, sizes)
        if mtp:
            _write_mtp(out, arch, seed)
    return out


def _write_mtp(out: Path, arch: str, seed: int) -> None:
    from safetensors.torch import save_file

    from ferry.plan.model_config import load_model_config
    from ferry.plan.mtp_layer import mtp_checkpoint_name
    from ferry.services.worker.models.mtp_head import random_mtp_tensors

    config = json.loads((out / "config.json").read_text())
    config[MTP_CONFIG_KEYS[arch]] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    spec = load_model_config(out)
    tensors = {mtp_checkpoint_name(spec, name): t for name, t in random_mtp_tensors(spec, seed + 2).items()}
    save_file(tensors, out / "mtp.safetensors")


def _write(out: Path, arch: str, seed: int, sizes: dict[str, int]) -> None:
    import torch
    from transformers import GenerationConfig

    from ferry.services.tiny_model.tokenizer import ENDOFTEXT, IM_END, train_tokenizer

    tokenizer = train_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = _config(arch, vocab_size=len(tokenizer), eos_token_id=eos_id, pad_token_id=pad_id, **sizes)

    model_class = _model_class(arch)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, do_sample=False).save_pretrained(out)
    (out / "ferry_tiny_model.json").write_text(json.dumps({"arch": arch, "seed": seed}) + "\n")


def _perturb_norms(model, seed: int) -> None:
    """Move every RMSNorm weight off its identity value (1, or 0 for norms computing x * (1 + w)):
    at identity a serving engine that applies the wrong convention would still match the reference."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight")):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def _config(arch: str, **ids):
    import transformers

    config_class = getattr(transformers, TINY_FAMILIES[arch].reference_classes[0])
    return config_class(**dict(TINY_CONFIGS[arch], **ids, dtype="float32"))


def _model_class(arch: str):
    import transformers

    return getattr(transformers, TINY_FAMILIES[arch].reference_classes[1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3_moe", help="architecture (default qwen3_moe)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a pure function of this (default 0)")
    parser.add_argument(
        "--mtp",
        action="store_true",
        help=f"also write a multi-token-prediction layer with random weights ({', '.join(MTP_CONFIG_KEYS)})",
    )
    parser.add_argument(
        "--gguf",
        choices=EXPERT_TYPES,
        default=None,
        help="also write DIR/tiny-TYPE.gguf, the checkpoint as a GGUF file with its routed experts in this ggml "
        f"type (rows widened to whole blocks: {', '.join(f'{k}={v}' for k, v in GGUF_SIZES.items())})",
    )


def run(args: argparse.Namespace) -> int:
    if args.gguf and TINY_FAMILIES[args.arch].gguf_write_metadata is None:
        print(f"ferry make-tiny-model: error: --gguf: {args.arch} has no GGUF layout here", file=sys.stderr)
        return 2
    sizes = GGUF_SIZES if args.gguf else {}
    if args.mtp and args.arch not in MTP_CONFIG_KEYS:
        print(f"ferry make-tiny-model: error: --mtp: {args.arch} has no MTP layer", file=sys.stderr)
        return 2
    out = make_tiny_model(args.dir, args.arch, args.seed, mtp=args.mtp, **sizes)
    print(f"wrote a tiny {args.arch} checkpoint (seed {args.seed}) to {out}")
    if args.gguf:
        path = write_gguf(out, out / f"tiny-{args.gguf}.gguf", args.gguf, seed=args.seed)
        print(f"wrote it as a GGUF file with {args.gguf} experts to {path}")
    return 0
