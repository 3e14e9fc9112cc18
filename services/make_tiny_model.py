"""`ferry make-tiny-model DIR --arch qwen3_moe|qwen3_5_moe [--seed N]`: the demo model and the tests' fixture.

A small random-weight checkpoint in the exact layout of a real one (config.json, safetensors,
tokenizer files, generation_config.json), written by transformers itself so the reference
implementation loads it unchanged. The weights are a pure function of the seed: the same seed
gives byte-identical safetensors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ARCHS = ("qwen3_moe", "qwen3_5_moe")

# Small enough to build and run in well under a second on CPU, big enough that every code path
# is real: GQA (4 query heads over 2 KV heads), several experts with top-2 routing, and for the
# hybrid both layer kinds with more value heads than key heads.
_COMMON = dict(
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
TINY_CONFIGS = {
    "qwen3_moe": dict(_COMMON, num_hidden_layers=3, intermediate_size=128, norm_topk_prob=True, rope_theta=10000.0),
    "qwen3_5_moe": dict(
        _COMMON,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        shared_expert_intermediate_size=32,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
}


def make_tiny_model(out_dir: str | Path, arch: str, seed: int = 0) -> Path:
    """Write the checkpoint into `out_dir` (created if needed) and return it."""
    from ferry.shared.file_modes import written_with_umask_modes

    if arch not in TINY_CONFIGS:
        raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with written_with_umask_modes(out):  # readable by others under the usual umask: a container serves it
        _write(out, arch, seed)
    return out


def _write(out: Path, arch: str, seed: int) -> None:
    import torch
    from transformers import GenerationConfig

    from ferry.services.tiny_model.tokenizer import ENDOFTEXT, IM_END, train_tokenizer

    tokenizer = train_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = _config(arch, vocab_size=len(tokenizer), eos_token_id=eos_id, pad_token_id=pad_id)

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
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def _config(arch: str, **ids):
    fields = dict(TINY_CONFIGS[arch], **ids, dtype="float32")
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**fields)
    # The text-only model: what Ferry serves of a qwen3_5_moe checkpoint, without a vision tower.
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**fields)


def _model_class(arch: str):
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    from transformers import Qwen3_5MoeForCausalLM

    return Qwen3_5MoeForCausalLM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3_moe", help="architecture (default qwen3_moe)")
    parser.add_argument("--seed", type=int, default=0, help="weights are a pure function of this (default 0)")


def run(args: argparse.Namespace) -> int:
    out = make_tiny_model(args.dir, args.arch, args.seed)
    print(f"wrote a tiny {args.arch} checkpoint (seed {args.seed}) to {out}")
    return 0
