"""`ferry make-bench-model DIR --config CONFIG`: a model directory of real shapes for benchmarks.

A published `config.json` (optionally cut to fewer layers), a byte-level tokenizer with exactly
the config's vocabulary (every id a random model samples decodes to printable text) and a
generation config: with `--load-format dummy` this serves at full size through every route,
chat included, with no download."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

def cut_config(config: dict, num_layers: int | None) -> dict:
    """The config with its text tower cut to the first `num_layers` layers (per-layer lists too)."""
    config = json.loads(json.dumps(config))
    if num_layers is None:
        return config
    text = config.get("text_config", config)
    total = text["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"--num-layers must be in 1..{total} for this config, got {num_layers}")
    text["num_hidden_layers"] = num_layers
    if isinstance(text.get("layer_types"), list):  # one entry per layer
        text["layer_types"] = text["layer_types"][:num_layers]
    if isinstance(text.get("mlp_only_layers"), list):  # layer indices
        text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if i < num_layers]
    return config


def write_bench_model(out_dir: str | Path, config_path: str | Path, num_layers: int | None = None) -> Path:
    """Write config.json, the tokenizer and generation_config.json into `out_dir`; return it."""
    from ferry.services.tiny_model.tokenizer import ENDOFTEXT, IM_END, printable_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = cut_config(json.loads(Path(config_path).read_text()), num_layers)
    text = config.get("text_config", config)
    tokenizer = printable_tokenizer(int(text["vocab_size"]))
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    # the model's own EOS ids would be arbitrary merges of this tokenizer: use its <|im_end|>
    for c in {id(config): config, id(text): text}.values():
        c["eos_token_id"], c["pad_token_id"] = eos, pad
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": pad}) + "\n")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument("--config", required=True, help="a model's config.json (e.g. a published checkpoint's)")
    parser.add_argument("--num-layers", type=int, default=None, help="keep only the first N decoder layers")


def run(args: argparse.Namespace) -> int:
    try:
        out = write_bench_model(args.dir, args.config, args.num_layers)
    except (OSError, ValueError, KeyError) as exc:
        print(f"ferry make-bench-model: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (config, tokenizer, generation config): serve it with --load-format dummy")
    return 0
