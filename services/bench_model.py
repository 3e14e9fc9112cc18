"""`ferry make-bench-model DIR --config CONFIG`: a model directory of real shapes for benchmarks.

A published `config.json` (optionally cut to fewer layers), a byte-level tokenizer with exactly
the config's vocabulary (every id a random model samples decodes to printable text; for gpt-oss,
whose chat format needs its own, o200k_harmony) and a generation config: with `--load-format dummy`
this serves at full size through every route, chat included, with no download.

`--format nvfp4|fp8|mxfp4` writes them (and config.json's quantization_config) in nvidia modelopt's NVFP4,
Qwen's FP8 block or gpt-oss's MXFP4 layout (services/quantized_checkpoint.py); without weights,
`--load-format dummy` then makes dummy experts in that format at full size.

`--format gguf-TYPE` (gguf-q4_k_m, gguf-q4_k, gguf-q8_0...: every type `ferry make-tiny-model --gguf` writes, but
F32) writes the model as one GGUF file, DIR/model-TYPE.gguf, alone in DIR so that `--model DIR` serves it, by the
tests' GGUF writer (services/gguf_writer.py): the dense tensors from the dummy recipe below, written F16 as llama.cpp
writes them, the routed experts random but valid blocks of the type (of the mix's types by layer) with the dummy
experts' spread, with `--weights random`. With `--weights none` (a GGUF file is its weights) nothing is drawn: the
file's tensor table is whole and its data a hole of its size (a sparse file, zeros when read), so `ferry plan`
plans a full-size GGUF (gpt-oss-120b's is 61 GiB) in the disk a metadata takes.

`--weights random` also writes the weights, as safetensors shards in the Hugging Face per-expert
layout (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`; `model.language_model.layers...` for a
multimodal wrapper's config, as Qwen3.5/3.6's published checkpoints name them), so that any engine — a peer
measured with the same client — loads the same model. They follow the dummy recipe
(services/worker/dummy_weights.py: a strong token embedding and weak output projections, so
routing changes with every token; `--routing-skew` makes some experts popular), and with no skew
the resident tensors are exactly what `--load-format dummy` makes."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from ferry.plan import expert_formats as F
from ferry.services.gguf_writer import EXPERT_TYPES as GGUF_EXPERT_TYPES
from ferry.services.gguf_writer import FLOAT_EXPERT_TYPES
from ferry.shared.file_modes import written_with_umask_modes


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
    if isinstance(text.get("per_layer_config"), dict):  # keyed by layer index (or by layer type)
        text["per_layer_config"] = {
            k: v for k, v in text["per_layer_config"].items() if not str(k).isdigit() or int(k) < num_layers
        }
    return config


SHARD_BYTES = 2 * 2**30
GGUF_PREFIX = "gguf-"
# --format gguf-TYPE -> the GGUF writer's expert type (float experts aside: a bench of GGUF is one of blocks)
GGUF_FORMATS = {f"{GGUF_PREFIX}{t.lower()}": t for t in GGUF_EXPERT_TYPES if t not in FLOAT_EXPERT_TYPES}
EXPERT_LAYOUTS = ("per-expert", "fused")
PER_EXPERT_NAME = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)")


class FusedExperts:
    """Collects a layer's per-expert tensors (they come layer by layer, expert by expert) and gives the layer's
    fused tensors once every part of its experts is in, as the model's family stores them
    (`DecoderFamily.fused_expert_tensors`: transformers' gate_up_proj [E, 2I, H] and down_proj [E, H, I] by
    default; gpt-oss's transposed, interleaved layout with its biases; quantized experts where the family
    publishes them fused, `fused_quantized_expert_tensors`: gpt-oss's mxfp4 blocks and scales)."""

    def __init__(self, spec):
        from ferry.services.worker.models.registry import family_named

        self.spec, self.family = spec, family_named(spec.arch)
        self.parts_per_expert = 6 if spec.expert_bias else 3
        # layer prefix -> expert -> "gate.weight" (a source tensor) -> {its tensors' leaves: tensor}
        self.parts: dict[str, dict[int, dict[str, dict[str, object]]]] = {}
        self.complete: dict[str, int] = {}  # experts of a layer with every part in

    def take(self, match: re.Match, tensors: dict) -> dict:
        """One source tensor's (`match`: its per-expert name) tensors as written: {} until its layer is complete,
        then the layer's fused tensors. Quantized, a linear's weight is several tensors (its leaves)."""
        import torch

        prefix, expert = match[1], int(match[2])
        parts = self.parts.setdefault(prefix, {}).setdefault(expert, {})
        module = match[0].rsplit(".", 1)[0]  # ...experts.E.gate_proj: its tensors are module.weight, .weight_blocks
        parts[f"{match[3]}.{match[4]}"] = {n[len(module) + 1 :]: t.cpu() for n, t in tensors.items()}
        if len(parts) == self.parts_per_expert:
            self.complete[prefix] = self.complete.get(prefix, 0) + 1
        if self.complete.get(prefix) != self.spec.num_experts:
            return {}
        layer = self.parts.pop(prefix)
        experts = [layer[e] for e in range(self.spec.num_experts)]
        bias = None
        if self.spec.expert_bias:
            bias = (
                torch.stack([torch.cat([p["gate.bias"]["bias"], p["up.bias"]["bias"]]) for p in experts]),
                torch.stack([p["down.bias"]["bias"] for p in experts]),
            )
        leaves = {
            leaf: (
                torch.stack([torch.cat([p["gate.weight"][leaf], p["up.weight"][leaf]]) for p in experts]),
                torch.stack([p["down.weight"][leaf] for p in experts]),
            )
            for leaf in experts[0]["gate.weight"]
        }
        if set(leaves) == {"weight"}:
            return self.family.fused_expert_tensors(self.spec, prefix, *leaves["weight"], bias)
        return self.family.fused_quantized_expert_tensors(self.spec, prefix, leaves, bias)


# Random weights take a while (Qwen3-30B-A3B cut to a few layers: 3.5 GiB in about 20 s): progress on
# stderr, as a bar on a terminal, else (a log file, CI) a line this often and one at the end.
PROGRESS_EVERY_S = 5.0


class _Progress:
    """Tensors drawn and bytes so far: a tqdm bar on a terminal, plain lines elsewhere (a bar's
    carriage-return redraws are noise in a file)."""

    def __init__(self, total: int, stream=None):
        from tqdm import tqdm

        stream = stream or sys.stderr
        self.total, self.stream = total, stream
        self.bar = (
            tqdm(total=total, desc="random weights", unit="tensor", file=stream, leave=False)
            if stream.isatty()
            else None
        )
        self.done = self.bytes = 0
        self.started = self.last = time.monotonic()

    def update(self, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        if self.bar is not None:
            self.bar.update(1)
        elif time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self._line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self._line()

    def _line(self) -> None:
        self.last = time.monotonic()
        print(
            f"make-bench-model: {self.done}/{self.total} tensors, {self.bytes / 2**30:.2f} GiB, "
            f"{self.last - self.started:.0f} s",
            file=self.stream,
            flush=True,
        )


def write_random_weights(
    out: Path,
    routing_skew: float = 0.0,
    seed: int = 0,
    device: str = "cpu",
    dtype: str = "bfloat16",
    fmt: str | None = None,
    expert_layout: str = "per-expert",
) -> int:
    """Shards of every tensor the model loads, named as the Hugging Face checkpoint; returns the bytes
    written. `fmt` (nvfp4 | fp8 | mxfp4): each linear quantized in that published layout
    (services/quantized_checkpoint.py), and config.json's quantization_config says so. `expert_layout`
    "fused" stores a layer's routed experts as transformers saves them, `experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I] (Qwen3.5/3.6's published bf16 layout, the only one some readers take)."""
    import torch
    from safetensors.torch import save_file

    from ferry.plan.costs import resident_weight_shapes
    from ferry.plan.model_config import load_model_config
    from ferry.services.quantized_checkpoint import quantize_tensors
    from ferry.services.worker.dummy_weights import dummy_tensor, routed_expert_shapes
    from ferry.services.worker.pools import TORCH_DTYPES

    spec = load_model_config(out)
    shapes = {**resident_weight_shapes(spec), **routed_expert_shapes(spec)}
    named = published_names(json.loads((out / "config.json").read_text()))
    weight_map, shard, shard_bytes, total, index = {}, {}, 0, 0, 0
    progress = _Progress(len(shapes))

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        if shard:
            index += 1
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            weight_map.update({n: name for n in shard})
            shard, shard_bytes = {}, 0

    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"--expert-layout must be one of {', '.join(EXPERT_LAYOUTS)}, got {expert_layout!r}")
    fused = FusedExperts(spec) if expert_layout == "fused" else None
    if fused is not None and fmt:  # refused now, before gigabytes are drawn, where the family has no such layout
        fused.family.fused_quantized_expert_tensors(spec, "", {}, None)
    for name, shape in shapes.items():
        t = dummy_tensor(spec, name, shape, TORCH_DTYPES[dtype], torch.device(device), seed, routing_skew)
        tensors = quantize_tensors(fmt, {name: t}) if fmt else {name: t}
        if fused is not None and (m := PER_EXPERT_NAME.fullmatch(name)):
            tensors = fused.take(m, tensors)
        for n, q in tensors.items():
            shard[named(n)] = q.cpu().contiguous()
            shard_bytes += q.nbytes
            total += q.nbytes
        if shard_bytes >= SHARD_BYTES:
            flush()
        progress.update(sum(q.nbytes for q in tensors.values()))
    flush()
    progress.close()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
    )
    if fmt:
        set_quantization(out, fmt, [named(n) for n in shapes])
    return total


def published_names(config: dict):
    """name -> the name the published checkpoint of this config gives that tensor, as the config's family
    says (plan/model_families/: a multimodal wrapper's text tensors sit under `model.language_model.`, which
    other engines' readers match exactly; Ferry reads either)."""
    from ferry.plan.model_families import family_for_config

    return family_for_config(config).published_names(config)


def set_quantization(out: Path, fmt: str, names: list[str]) -> None:
    """config.json's quantization_config for a checkpoint of these tensors in format `fmt`."""
    from ferry.services.quantized_checkpoint import quantization_config

    path = out / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization_config(fmt, names)
    path.write_text(json.dumps(config, indent=2) + "\n")


def write_gguf_bench_model(
    out_dir: str | Path,
    config_path: str | Path,
    expert_type: str,
    num_layers: int | None = None,
    routing_skew: float = 0.0,
    seed: int = 0,
    device: str = "cpu",
    holes: bool = False,
) -> Path:
    """The model as one GGUF file of routed experts in `expert_type` (a GGUF writer's type or _M mix), written into
    `out_dir` alone; returns its path. The config and tokenizer go through a scratch directory the writer reads.
    `holes`: no tensor drawn, the file's data a hole of its size (gguf_writer.write_gguf): a full-size model's
    file for `ferry plan` in no disk and memory to speak of; served, its weights are zeros."""
    import tempfile

    import numpy as np

    from ferry.plan.costs import resident_weight_shapes
    from ferry.plan.model_config import load_model_config
    from ferry.services.gguf_writer import write_gguf, zeros
    from ferry.services.worker.dummy_weights import LINEAR_STD, OUTPUT_STD

    out = Path(out_dir)
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty: a GGUF bench model is written into a directory of its own")
    with tempfile.TemporaryDirectory(prefix="ferry-gguf-bench-") as scratch:
        source = write_bench_model(Path(scratch) / "source", config_path, num_layers)
        spec = load_model_config(source)
        named = published_names(json.loads((source / "config.json").read_text()))
        shapes = resident_weight_shapes(spec)
        if holes:
            tensors = {named(name): zeros(shape, np.float32) for name, shape in shapes.items()}
        else:
            tensors = _dummy_tensors(spec, shapes, named, seed, routing_skew, device)
        # the dummy recipe's routed experts: the gate and up rows of a linear's spread, down's weaker
        return write_gguf(
            source,
            out / f"model-{expert_type}.gguf",
            expert_type,
            seed=seed,
            tensors=tensors,
            random_experts=(LINEAR_STD, OUTPUT_STD),
            holes=holes,
        )


def _dummy_tensors(spec, shapes: dict, named, seed: int, routing_skew: float, device: str) -> dict:
    """The dummy recipe's tensors of `shapes` as float32 numpy arrays, by published name."""
    import torch

    from ferry.services.worker.dummy_weights import dummy_tensor

    progress = _Progress(len(shapes))
    tensors = {}
    for name, shape in shapes.items():
        t = dummy_tensor(spec, name, shape, torch.float32, torch.device(device), seed, routing_skew)
        tensors[named(name)] = t.cpu().numpy()
        progress.update(t.nbytes)
    progress.close()
    return tensors


def write_bench_model(out_dir: str | Path, config_path: str | Path, num_layers: int | None = None) -> Path:
    """Write config.json, the tokenizer and generation_config.json into `out_dir`; return it. The tokenizer: the
    printable one of the config's vocabulary, or for a family whose models speak harmony (gpt-oss) its own,
    o200k_harmony, which the api's harmony chat format requires (where the vocabulary holds it: not a tiny
    config's)."""
    from ferry.plan.model_families import family_for_config
    from ferry.services.tiny_model.harmony_tokenizer import LAST_SPECIAL as HARMONY_LAST_SPECIAL
    from ferry.services.tiny_model.harmony_tokenizer import harmony_tokenizer
    from ferry.services.tiny_model.tokenizer import ENDOFTEXT, IM_END, printable_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = cut_config(json.loads(Path(config_path).read_text()), num_layers)
    text = config.get("text_config", config)
    vocab = int(text["vocab_size"])
    if family_for_config(config).chat_format == "harmony" and vocab > HARMONY_LAST_SPECIAL:  # not a tiny config's
        tokenizer = harmony_tokenizer(vocab)
    else:
        tokenizer = printable_tokenizer(vocab)
    eos = tokenizer.convert_tokens_to_ids(IM_END) if IM_END in tokenizer.get_vocab() else tokenizer.eos_token_id
    pad = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    # the model's own EOS ids would be arbitrary merges of the printable tokenizer: use its <|im_end|> (harmony's
    # own end of a reply, <|return|>, in o200k_harmony)
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
    parser.add_argument(
        "--weights",
        choices=("none", "random"),
        default="none",
        help="none (default): serve with --load-format dummy; random: also write safetensors "
        "weights whose routing changes with every token",
    )
    parser.add_argument(
        "--routing-skew",
        type=float,
        default=0.0,
        help="with --weights random: 0 (default) routes uniformly, s > 0 makes expert of rank r "
        "about r^-s as likely (a logit bias of -s ln(1 + r))",
    )
    parser.add_argument("--seed", type=int, default=0, help="the weights are a pure function of this")
    parser.add_argument(
        "--expert-layout",
        choices=EXPERT_LAYOUTS,
        default="per-expert",
        help="with --weights random: per-expert (default) names each expert's projections, "
        "layers.N.mlp.experts.E.{gate,up,down}_proj.weight; fused stores a layer's experts as two tensors, "
        "experts.gate_up_proj and experts.down_proj, as transformers saves them (quantized only where the family "
        "publishes them fused: gpt-oss's experts.gate_up_proj_blocks and the rest, as openai does)",
    )
    parser.add_argument("--generate-on", default="cpu", help="device that draws the random weights (cpu, cuda)")
    parser.add_argument(
        "--format",
        choices=(*F.checkpoint_layouts(), *GGUF_FORMATS),
        default="bf16",
        help="bf16 (default); nvfp4: nvidia modelopt's NVFP4 layout (routed and shared experts); "
        "fp8: Qwen's FP8 layout (128 x 128 blocks); mxfp4: gpt-oss's MXFP4 layout (routed experts, "
        "per linear). With --weights none, config.json says the "
        "format and --load-format dummy serves it. gguf-TYPE: DIR/model-TYPE.gguf, with --weights random "
        "the routed experts random blocks of that ggml type (gguf-q4_k_m, gguf-q5_k_m: llama.cpp's mixes), "
        "with --weights none a sparse file of the whole tensor table and no bytes (zeros), for ferry plan",
    )


def run(args: argparse.Namespace) -> int:
    if args.routing_skew < 0:
        print("ferry make-bench-model: error: --routing-skew must be >= 0", file=sys.stderr)
        return 2
    if args.routing_skew and args.weights != "random":
        print("ferry make-bench-model: error: --routing-skew needs --weights random", file=sys.stderr)
        return 2
    if args.expert_layout != "per-expert" and args.weights != "random":
        print("ferry make-bench-model: error: --expert-layout needs --weights random", file=sys.stderr)
        return 2
    if args.format in GGUF_FORMATS:
        return _run_gguf(args)
    fmt = args.format if F.for_checkpoint_layout(args.format).quantized else None
    try:
        with written_with_umask_modes(args.dir):  # readable by others under the usual umask: a container serves it
            out, size = _write(args, fmt)
    except (OSError, ValueError, KeyError) as exc:
        print(f"ferry make-bench-model: error: {exc}", file=sys.stderr)
        return 2
    if size is not None:
        print(
            f"wrote {out} with {size / 2**30:.2f} GiB of random weights in {args.format} "
            f"(routing skew {args.routing_skew})"
        )
    else:
        print(f"wrote {out} (config, tokenizer, generation config): serve it with --load-format dummy")
    return 0


def _run_gguf(args: argparse.Namespace) -> int:
    if args.expert_layout != "per-expert":
        print(
            f"ferry make-bench-model: error: --expert-layout {args.expert_layout} is a safetensors layout: "
            f"--format {args.format} lays the experts out as GGUF does",
            file=sys.stderr,
        )
        return 2
    try:
        with written_with_umask_modes(args.dir):
            path = write_gguf_bench_model(
                args.dir,
                args.config,
                GGUF_FORMATS[args.format],
                args.num_layers,
                args.routing_skew,
                args.seed,
                args.generate_on,
                holes=args.weights != "random",
            )
    except (OSError, ValueError, KeyError) as exc:
        print(f"ferry make-bench-model: error: {exc}", file=sys.stderr)
        return 2
    if args.weights != "random":
        print(
            f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB of holes, {_disk_bytes(path) / 2**20:.1f} MiB on "
            f"disk: its tensors' bytes unwritten, zeros when read): `ferry plan --model {args.dir}` plans it; add "
            "--weights random for a model to serve"
        )
        return 0
    print(
        f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB; routing skew {args.routing_skew}): "
        f"serve it with --model {args.dir}"
    )
    return 0


def _disk_bytes(path: Path) -> int:
    """The bytes a file takes on disk (a sparse file's holes take none)."""
    return path.stat().st_blocks * 512


def _write(args: argparse.Namespace, fmt: str | None) -> tuple[Path, int | None]:
    """The model directory, and the bytes of random weights written (None: no weights)."""
    out = write_bench_model(args.dir, args.config, args.num_layers)
    if fmt and not F.for_checkpoint_layout(args.format).holds_biases:
        from ferry.plan.model_config import load_model_config

        if load_model_config(out).expert_bias:
            raise ValueError(f"--format {args.format} holds no expert biases, which this model's experts have")
    if args.weights == "random":
        return out, write_random_weights(
            out, args.routing_skew, args.seed, args.generate_on, fmt=fmt, expert_layout=args.expert_layout
        )
    if fmt:
        from ferry.plan.costs import resident_weight_shapes
        from ferry.plan.model_config import load_model_config
        from ferry.services.worker.dummy_weights import routed_expert_shapes

        spec = load_model_config(out)
        set_quantization(out, fmt, [*resident_weight_shapes(spec), *routed_expert_shapes(spec)])
    return out, None
