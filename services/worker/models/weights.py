"""Checkpoint tensors into a CausalLM: name normalisation, layout conversion, and completeness.

Accepted names (each optionally prefixed `model.`, or `model.language_model.` for the multimodal
qwen3_5_moe wrapper; `lm_head.weight` unprefixed):
* every parameter of the module tree under its checkpoint name (`layers.3.self_attn.q_proj.weight`...);
* routed experts, per expert (published Qwen checkpoints, and what transformers' save_pretrained
  writes): `layers.L.mlp.experts.E.{gate,up,down}_proj.weight`; or fused (transformers' in-memory
  state_dict): `layers.L.mlp.experts.gate_up_proj` [E, 2I, H] and `layers.L.mlp.experts.down_proj`
  [E, H, I]. Both go to `ExpertStore.load_expert`, never into the module tree; where the spec's
  `expert_bias`, with their biases, per expert `…experts.E.{gate,up,down}_proj.bias` or fused
  `…experts.gate_up_proj_bias` [E, 2I] (gate's, then up's) and `…experts.down_proj_bias` [E, H];
* Gated DeltaNet input projections `in_proj_qkv|z|b|a`, written into row blocks of our single `in_proj`;
* whatever the model's family converts first (`DecoderFamily.checkpoint_tensors`: qwen3_next's
  interleaved `in_proj_qkvz` / `in_proj_ba` become the four above);
* tensors a module keeps as row blocks of one fused parameter, as its `checkpoint_rows` lists
  them (layers/mlp.py: `mlp.gate.weight` and `mlp.shared_expert_gate.weight` into the router's
  `gate.logit_weight`, `gate_proj.weight` and `up_proj.weight` into a dense MLP's `gate_up_proj`).
  Each is written into its row view, checked against the view's shape, and expected once.
Vision-tower (`visual.`) and multi-token-prediction (`mtp.`, and the spec's `mtp_layers` stored as
layers past the decoder's) tensors are skipped: only the text model is served. Anything else, or
anything missing at the end, raises WeightLoadError naming it.

Quantized linears arrive as one `QuantizedWeight` each (services/worker/quantized_weight.py): a
routed expert's go to the store as they are (it keeps them in their format), every other one is
dequantized once, on the model's device, into its bf16 parameter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from ferry.plan.costs import is_served
from ferry.services.worker.expert_formats.expert_shapes import ExpertBias
from ferry.services.worker.quantized_weight import QuantizedWeight, quantized_weight, row_slice
from ferry.shared.errors import ModelLoadError

PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
SKIPPED_PREFIXES = (
    "visual.",
    "mtp.",
    "model.visual.",
    "model.mtp.",
    "vision_tower.",
    "embed_vision.",
    "audio_tower.",
    "embed_audio.",
)

# a layer's routed experts sit under `mlp.experts.`, or `experts.` beside a dense `mlp.` (Gemma 4)
_PER_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp\.)?experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)")
_FUSED_EXPERTS = re.compile(
    r"layers\.(\d+)\.(?:mlp\.)?experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?(?:\.weight)?"
)
# fused quantized experts: each family's weight as its `_blocks` and `_scales` tensors ([E, O, ...] each)
QUANTIZED_FUSED_PARTS = ("_blocks", "_scales")
_IN_PROJ = re.compile(r"(layers\.(\d+)\.linear_attn)\.(in_proj_(?:qkv|z|b|a))\.weight")


class WeightLoadError(ModelLoadError):
    """A checkpoint tensor is missing, unexpected, or of the wrong shape."""


def canonical_name(name: str) -> str | None:
    """The name without its wrapper prefix; None for tensors of parts we do not serve."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if name.startswith(SKIPPED_PREFIXES):
        return None
    return name


class _Loader:
    def __init__(self, model, routed_experts: bool = True):
        self.model = model
        self.spec = model.spec
        self.family = model.family
        self.params = dict(model.named_parameters())
        # checkpoint name -> (fused parameter, its rows); the fused parameters are pending by part
        self.rows = fused_rows(model)
        self.fused_params = {param for param, _ in self.rows.values()}
        self.pending: set[str] = set(self.rows)
        for name in self.params:
            if name in self.fused_params:
                continue
            if name.endswith("linear_attn.in_proj.weight"):
                layer = name.removesuffix(".in_proj.weight")
                self.pending.update(f"{layer}.in_proj[{part}]" for part in ("qkv", "z", "b", "a"))
            else:
                self.pending.add(name)
        if routed_experts:  # False: the expert store was filled by other means (dummy host banks)
            self.pending.update(
                f"expert[{m}][{e}]"
                for m in range(len(self.spec.moe_layer_indices))
                for e in range(self.spec.num_experts)
            )
        first = next(iter(self.params.values()), None)
        self.dtype = first.dtype if first is not None else torch.float32
        self.device = first.device if first is not None else torch.device("cpu")
        self.per_expert: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.fused: dict[int, dict[str, torch.Tensor]] = {}

    # ---- helpers -------------------------------------------------------------------------
    def _done(self, key: str, source: str) -> None:
        if key not in self.pending:
            raise WeightLoadError(f"checkpoint tensor {source!r} is given twice or does not belong to this model")
        self.pending.discard(key)

    def _copy(self, target: torch.Tensor, tensor: torch.Tensor, source: str) -> None:
        if tuple(target.shape) != tuple(tensor.shape):
            raise WeightLoadError(
                f"checkpoint tensor {source!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)} "
                "for this config.json"
            )
        target.copy_(tensor)

    def _moe_layer(self, layer: int, source: str) -> int:
        if layer >= self.spec.num_layers or not self.spec.moe_layers[layer]:
            raise WeightLoadError(f"unexpected checkpoint tensor {source!r}: layer {layer} has no routed experts")
        return self.spec.moe_layer_indices.index(layer)

    # ---- one tensor ----------------------------------------------------------------------
    @torch.no_grad()
    def take(self, source: str, tensor: torch.Tensor) -> None:
        name = canonical_name(source)
        if name is None or not is_served(source, self.spec):
            return
        if name == "lm_head.weight" and self.model.lm_head is None:
            return  # tied embeddings: the head is embed_tokens; a saved copy is redundant
        if m := _PER_EXPERT.fullmatch(name):
            part = m[3] if m[4] == "weight" else f"{m[3]}.bias"
            self._expert_part(self._moe_layer(int(m[1]), source), int(m[2]), part, tensor, source)
            return
        if isinstance(tensor, QuantizedWeight):  # a dense linear: dequantized once, here
            if _FUSED_EXPERTS.fullmatch(name):
                raise WeightLoadError(
                    f"checkpoint tensor {source!r}: quantized experts must be stored per expert "
                    "(layers.L.mlp.experts.E.{gate,up,down}_proj)"
                )
            tensor = tensor.dequantize(self.dtype, self.device)
        for part, piece in self.family.checkpoint_tensors(self.spec, name, tensor, source):
            self._dense(part, piece, source)

    def _dense(self, name: str, tensor: torch.Tensor, source: str) -> None:
        """A tensor of the module tree (or of routed experts fused), under its name there."""
        if m := _FUSED_EXPERTS.fullmatch(name):
            self._fused_experts(self._moe_layer(int(m[1]), source), m[2] + (m[3] or ""), tensor, source)
        elif m := _IN_PROJ.fullmatch(name):
            self._in_proj(m[1], m[3], tensor, source)
        elif name in self.rows:
            param, rows = self.rows[name]
            self._done(name, source)
            self._copy(self.params[param][rows], tensor, source)
        elif name in self.params and name not in self.fused_params:  # a fused one is loaded by its parts
            self._done(name, source)
            self._copy(self.params[name], tensor, source)
        else:
            raise WeightLoadError(
                f"unexpected checkpoint tensor {source!r}: no {self.spec.arch} parameter of that name"
            )

    def _expert_part(self, moe_layer: int, expert: int, part: str, tensor: torch.Tensor, source: str) -> None:
        if expert >= self.spec.num_experts:
            raise WeightLoadError(f"unexpected checkpoint tensor {source!r}: num_experts is {self.spec.num_experts}")
        if part.endswith(".bias") and not self.spec.expert_bias:
            raise WeightLoadError(f"unexpected checkpoint tensor {source!r}: this model's experts have no biases")
        h, i = self.spec.hidden_size, self.spec.moe_intermediate_size
        expected = {"down_proj": (h, i), "down_proj.bias": (h,)}.get(part, (i,) if part.endswith(".bias") else (i, h))
        if tuple(tensor.shape) != expected:
            raise WeightLoadError(f"checkpoint tensor {source!r} has shape {tuple(tensor.shape)}, expected {expected}")
        parts = self.per_expert.setdefault((moe_layer, expert), {})
        if part in parts:
            raise WeightLoadError(f"checkpoint tensor {source!r} is given twice")
        parts[part] = tensor
        if len(parts) == (6 if self.spec.expert_bias else 3):
            del self.per_expert[(moe_layer, expert)]
            self._done(f"expert[{moe_layer}][{expert}]", source)
            bias = None
            if self.spec.expert_bias:
                gate_up = torch.cat([parts["gate_proj.bias"], parts["up_proj.bias"]])
                bias = ExpertBias(gate_up, parts["down_proj.bias"])
            self._load_expert(moe_layer, expert, parts["gate_proj"], parts["up_proj"], parts["down_proj"], bias)

    def _load_expert(self, moe_layer: int, expert: int, gate, up, down, bias: ExpertBias | None) -> None:
        """Into the store; `bias` only where the experts have biases (a store of unbiased experts takes none)."""
        if bias is None:
            self.model.experts.load_expert(moe_layer, expert, gate, up, down)
        else:
            self.model.experts.load_expert(moe_layer, expert, gate, up, down, bias)

    def _fused_experts(self, moe_layer: int, part: str, tensor: torch.Tensor, source: str) -> None:
        """A layer's experts stored fused: each family one tensor [E, ...] (gate_up_proj [E, 2I, H] the gate's
        rows then the up's, down_proj [E, H, I]), or quantized as its `_blocks` and `_scales` tensors (read
        by quantized_weight.py per expert), and `_bias` tensors where the experts have biases."""
        e, h, i = self.spec.num_experts, self.spec.hidden_size, self.spec.moe_intermediate_size
        if part.endswith("_bias") and not self.spec.expert_bias:
            raise WeightLoadError(f"unexpected checkpoint tensor {source!r}: this model's experts have no biases")
        expected = {
            "gate_up_proj": (e, 2 * i, h),
            "down_proj": (e, h, i),
            "gate_up_proj_bias": (e, 2 * i),
            "down_proj_bias": (e, h),
        }.get(part)
        if expected is not None and tuple(tensor.shape) != expected:
            raise WeightLoadError(f"checkpoint tensor {source!r} has shape {tuple(tensor.shape)}, expected {expected}")
        if expected is None and (tensor.dim() < 2 or tuple(tensor.shape[:2]) != (e, 2 * i if "gate" in part else h)):
            want = (e, 2 * i if "gate" in part else h)
            raise WeightLoadError(f"checkpoint tensor {source!r} has shape {tuple(tensor.shape)}, expected {want}, ...")
        parts = self.fused.setdefault(moe_layer, {})
        if part in parts:
            raise WeightLoadError(f"checkpoint tensor {source!r} is given twice")
        parts[part] = tensor
        quantized = any(p.endswith(QUANTIZED_FUSED_PARTS) for p in parts)
        if len(parts) < (4 if quantized else 2) + (2 if self.spec.expert_bias else 0):
            return
        del self.fused[moe_layer]
        prefix = source.rsplit(".", 1)[0]
        for expert in range(e):
            self._done(f"expert[{moe_layer}][{expert}]", source)
            if quantized:  # each expert's `_blocks` / `_scales` as the per-linear `weight_blocks` / `weight_scales`
                gate_up, down = (
                    quantized_weight(
                        f"{prefix}.{expert}.{proj}",
                        {f"weight{s}": parts[f"{proj}{s}"][expert] for s in QUANTIZED_FUSED_PARTS},
                    )
                    for proj in ("gate_up_proj", "down_proj")
                )
                gate, up = row_slice(gate_up, 0, i), row_slice(gate_up, i, 2 * i)
            else:
                gate, up = parts["gate_up_proj"][expert][:i], parts["gate_up_proj"][expert][i:]
                down = parts["down_proj"][expert]
            bias = None
            if self.spec.expert_bias:
                bias = ExpertBias(parts["gate_up_proj_bias"][expert], parts["down_proj_bias"][expert])
            self._load_expert(moe_layer, expert, gate, up, down, bias)

    def _in_proj(self, layer: str, kind: str, tensor: torch.Tensor, source: str) -> None:
        target = self.params.get(f"{layer}.in_proj.weight")
        if target is None:
            raise WeightLoadError(f"unexpected checkpoint tensor {source!r}: {layer} is not a linear-attention layer")
        module = self.model.get_submodule(layer)
        part = kind.removeprefix("in_proj_")
        self._done(f"{layer}.in_proj[{part}]", source)
        self._copy(target[module.in_proj_rows(part)], tensor, source)

    def finish(self) -> None:
        if self.pending:
            missing = sorted(self.pending)
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise WeightLoadError(
                f"the checkpoint lacks {len(missing)} tensor(s) of this {self.spec.arch} model: {shown}"
            )


def fused_rows(model) -> dict[str, tuple[str, slice]]:
    """{checkpoint name (unprefixed): (parameter name, rows)} from every module's `checkpoint_rows`."""
    out: dict[str, tuple[str, slice]] = {}
    for prefix, module in model.named_modules():
        for param, parts in getattr(module, "checkpoint_rows", {}).items():
            for source, rows in parts.items():
                out[f"{prefix}.{source}" if prefix else source] = (f"{prefix}.{param}" if prefix else param, rows)
    return out


def checkpoint_shapes(model) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this model holds, under the names `save_pretrained` writes
    (per-expert routed experts; the Gated DeltaNet's in_proj as its family's checkpoints store it),
    with its shape: what a dummy-weights loader fabricates."""
    spec = model.spec
    shapes: dict[str, tuple[int, ...]] = {}
    parts_of: dict[str, list[tuple[str, slice]]] = {}
    for source, (param, rows) in fused_rows(model).items():
        parts_of.setdefault(param, []).append((source, rows))
    for name, param in model.named_parameters():
        full = name if name.startswith("lm_head.") else f"model.{name}"
        if name in parts_of:  # a fused parameter: its parts, as the checkpoint stores them
            for source, rows in parts_of[name]:
                shapes[f"model.{source}"] = (rows.stop - rows.start, *param.shape[1:])
            continue
        if not name.endswith("linear_attn.in_proj.weight"):
            shapes[full] = tuple(param.shape)
            continue
        layer = full.removesuffix(".in_proj.weight")
        module = model.get_submodule(name.removesuffix(".in_proj.weight"))
        for part, rows in module.in_proj_parts.items():
            shapes[f"{layer}.in_proj_{part}.weight"] = (rows, spec.hidden_size)
    shapes = model.family.checkpoint_names(spec, shapes)
    return {**shapes, **routed_expert_shapes(spec)}


def routed_expert_shapes(spec) -> dict[str, tuple[int, ...]]:
    """Every routed expert's tensors under the per-expert names transformers writes (with biases where the
    experts have them)."""
    h, i = spec.hidden_size, spec.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in spec.moe_layer_indices:
        for e in range(spec.num_experts):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            shapes[f"{prefix}.gate_proj.weight"] = (i, h)
            shapes[f"{prefix}.up_proj.weight"] = (i, h)
            shapes[f"{prefix}.down_proj.weight"] = (h, i)
            if spec.expert_bias:
                shapes[f"{prefix}.gate_proj.bias"] = (i,)
                shapes[f"{prefix}.up_proj.bias"] = (i,)
                shapes[f"{prefix}.down_proj.bias"] = (h,)
    return shapes


def load_checkpoint_weights(model, weights: Iterable[tuple[str, torch.Tensor]], routed_experts: bool = True) -> None:
    """`routed_experts=False`: the weights hold no routed expert and none is expected."""
    loader = _Loader(model, routed_experts)
    for name, tensor in weights:
        loader.take(name, tensor)
        # copied, so let it go before the next is asked for: boot measures the weights and plans between the two
        # passes (inside that next), and a kept tensor pins the allocator segment it was carved from
        del tensor
    loader.finish()
