"""The decoder every family shares: pre-norm token mixer + pre-norm MLP per layer (both residual), the
causal LM around the layers, and `DecoderFamily`, what a family fills in (which mixer each layer uses, its
norms, its MLPs, its rotary embedding and its checkpoint's names), built from services/worker/layers/."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ferry.kernels.expert_rows_sum import ExpertRows
from ferry.plan.model_config import ModelSpec
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.layers.context import StepContext
from ferry.services.worker.layers.mlp import DenseMLP, SparseMoeBlock
from ferry.services.worker.layers.norms import make_norm
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.services.worker.models.weights import checkpoint_shapes, load_checkpoint_weights
from ferry.services.worker.offload.stores.expert_store import ExpertStore
from ferry.services.worker.pools import Pools
from ferry.shared.errors import ConfigError

Tensors = Iterable[tuple[str, torch.Tensor]]


class DecoderLayer(nn.Module):
    """Layer `layer_idx`: `mixer` is registered under `mixer_name`, the checkpoint's name for it (`self_attn`,
    `linear_attn`); `moe`: the MLP is a MoE block, whose routed experts' rows the next norm may sum (see forward)."""

    def __init__(
        self,
        layer_idx: int,
        mixer_name: str,
        mixer: nn.Module,
        mlp: nn.Module,
        norms: tuple[nn.Module, nn.Module],
        moe: bool,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.mlp = mlp
        self._moe = moe
        self.input_layernorm, self.post_attention_layernorm = norms

    def forward(
        self, x: torch.Tensor | ExpertRows, residual: torch.Tensor | None, ctx: StepContext
    ) -> tuple[torch.Tensor | ExpertRows, torch.Tensor]:
        """The layer's input is residual + x (x alone for the first layer, residual None); returns
        (mlp output, residual), the add left to the next norm. Each residual add is thus fused
        into the RMSNorm after it (one kernel on CUDA instead of two); the sums are the same. A MoE
        block's output may be its routed experts' unsummed rows (ExpertRows): that norm sums them."""
        mixer = self._modules[self.mixer_name]
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h, residual = self.post_attention_layernorm.forward_add(ctx.mix(mixer, h, self.layer_idx), residual)
        return (self.mlp(h, ctx, summed=False) if self._moe else self.mlp(h, ctx)), residual


class DecoderFamily(ABC):
    """The torch half of a model family (services/worker/models/registry.py says how one registers).

    A family overrides `mixer` (which token mixer layer i uses, under which checkpoint name) and what else
    differs from these defaults: a RoPE rotary embedding, RMSNorms (zero-centred where the spec says), the
    MoE block where `spec.moe_layers` says and a dense SwiGLU MLP elsewhere, checkpoint tensors named as the
    module tree (`checkpoint_tensors` / `checkpoint_names` convert a layout stored otherwise)."""

    def __init__(self, name: str):
        self.name = name  # the plan family's name: ModelSpec.arch

    def check(self, spec: ModelSpec) -> None:
        """A ConfigError naming the config.json field for what this composition does not compute."""
        if spec.text_config.get("hidden_act", "silu") != "silu":
            raise ConfigError(
                f"config.json: hidden_act {spec.text_config['hidden_act']!r} is not supported (silu only)"
            )
        if spec.text_config.get("use_sliding_window"):
            # transformers then limits every attention layer to `sliding_window` keys; we attend to all
            raise ConfigError("config.json: use_sliding_window=true is not supported (full causal attention only)")

    def rotary(self, spec: ModelSpec, device) -> RotaryEmbedding:
        return RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta, device, spec.rope_yarn)

    def rotaries(self, spec: ModelSpec, device) -> list[RotaryEmbedding]:
        """Every rotary embedding the layers use, the first the model's `rotary`: one, unless layers turn
        differently (then `rotary_of` says which a layer takes)."""
        return [self.rotary(spec, device)]

    def rotary_of(self, spec: ModelSpec, layer: int) -> int:
        """The index in `rotaries` of layer `layer`'s rotary embedding."""
        return 0

    def norm(self, spec: ModelSpec, dim: int, dtype: torch.dtype, device) -> nn.Module:
        return make_norm(spec.zero_centered_norms, dim, spec.rms_norm_eps, dtype, device)

    @abstractmethod
    def mixer(
        self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, dtype: torch.dtype, device
    ) -> tuple[str, nn.Module]:
        """(checkpoint name, module) of layer `layer`'s token mixer."""

    def mlp(self, spec: ModelSpec, layer: int, experts: ExpertStore, dtype: torch.dtype, device) -> nn.Module:
        if spec.moe_layers[layer]:
            return SparseMoeBlock(spec, spec.moe_layer_indices.index(layer), experts, dtype, device)
        return DenseMLP(spec.hidden_size, spec.intermediate_size, dtype, device)

    def layer(
        self, spec: ModelSpec, layer: int, rotary: RotaryEmbedding, experts: ExpertStore, dtype: torch.dtype, device
    ) -> DecoderLayer:
        name, mixer = self.mixer(spec, layer, rotary, dtype, device)
        mlp = self.mlp(spec, layer, experts, dtype, device)
        norms = tuple(self.norm(spec, spec.hidden_size, dtype, device) for _ in range(2))
        return DecoderLayer(layer, name, mixer, mlp, norms, moe=spec.moe_layers[layer])

    def checkpoint_tensors(self, spec: ModelSpec, name: str, tensor: torch.Tensor, source: str) -> Tensors:
        """One checkpoint tensor (its name without the wrapper prefix) as the tensors the module tree names;
        `source`, the checkpoint's own name, is for errors (models/weights.py's WeightLoadError)."""
        return ((name, tensor),)

    def checkpoint_names(self, spec: ModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """`checkpoint_tensors` inverted: {name as the module tree has it: shape} -> as the checkpoint stores it."""
        return shapes

    def fused_expert_tensors(
        self,
        spec: ModelSpec,
        prefix: str,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        bias: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> dict[str, torch.Tensor]:
        """One layer's routed experts as the family's fused checkpoints store them (`ferry make-bench-model
        --expert-layout fused`): from gate_up [E, 2I, H] (each expert's gate rows, then its up rows), down
        [E, H, I] and, where the experts have them, their biases ([E, 2I], [E, H]); `prefix` is the layer's
        `model.layers.N.mlp.experts`. By default transformers' fused layout of Qwen3.5/3.6, what models/weights.py
        reads without conversion."""
        tensors = {f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down}
        if bias is not None:
            tensors[f"{prefix}.gate_up_proj_bias"], tensors[f"{prefix}.down_proj_bias"] = bias
        return tensors

    def fused_quantized_expert_tensors(
        self,
        spec: ModelSpec,
        prefix: str,
        leaves: dict[str, tuple[torch.Tensor, torch.Tensor]],
        bias: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> dict[str, torch.Tensor]:
        """`fused_expert_tensors` for quantized experts: `leaves` maps each tensor of a quantized linear (its name
        after the projection, e.g. `weight_blocks`) to (gate_up [E, 2I, ...] (gate rows, then up rows), down
        [E, H, ...]). Only a family whose published checkpoints fuse quantized experts has such a layout."""
        raise ValueError(
            f"{spec.arch} publishes no fused layout of quantized experts: write them per expert (--expert-layout "
            "per-expert)"
        )


class CausalLM(nn.Module):
    """Embedding, the family's decoder layers, final norm and head.

    Parameter names mirror the checkpoints' (without the `model.` prefix), so `load_weights`
    maps most tensors by name; see weights.py for the rest."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device, experts: ExpertStore, family: DecoderFamily):
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        self.family = family
        object.__setattr__(self, "experts", experts)  # not a submodule: see SparseMoeBlock
        self.rotaries = nn.ModuleList(family.rotaries(spec, device))
        self.rotary = self.rotaries[0]
        for index, rotary in enumerate(self.rotaries):
            rotary.table_index = index  # its tables' place in the step's StepContext.tables
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            family.layer(spec, i, self.rotaries[family.rotary_of(spec, i)], experts, dtype, device)
            for i in range(spec.num_layers)
        )
        self.norm = family.norm(spec, spec.hidden_size, dtype, device)
        self.lm_head = None
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype, device=device)
            self.lm_head.weight.requires_grad_(False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], routed_experts: bool = True) -> None:
        """Take checkpoint tensors (name, tensor); raises WeightLoadError on a missing or unexpected one.
        `routed_experts=False`: the expert store is filled elsewhere (dummy host banks), expect none."""
        load_checkpoint_weights(self, weights, routed_experts)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """{checkpoint tensor name: shape} of this model, as save_pretrained names them (dummy weights)."""
        return checkpoint_shapes(self)

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, pools: Pools) -> torch.Tensor:
        """Final-normed hidden states of every new token, [T, hidden]."""
        if self.spec.linear_attention_layers and pools.linear_state is None:
            raise ValueError("this model has linear-attention layers but the pools have no linear_state pool")
        tables = tuple(rotary.cos_sin(batch.positions, self.dtype) for rotary in self.rotaries)
        (cos, sin), linear = tables[0], bool(self.spec.linear_attention_layers)
        ctx = StepContext.of(batch, pools, cos, sin, linear, tables if len(tables) > 1 else ())
        x, residual = self.embed(batch.tokens), None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.norm(x) if residual is None else self.norm.forward_add(x, residual)[0]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, times the spec's `embedding_multiplier` rounded to the dtype (as transformers'
        Gemma scales them) where it is not 1."""
        x = self.embed_tokens(tokens)
        if self.spec.embedding_multiplier != 1.0:
            x = x * torch.tensor(self.spec.embedding_multiplier, dtype=torch.float32).to(x.dtype)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits, soft-capped (cap * tanh(logits / cap)) where the spec's `final_logit_softcapping`."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, head).float()
        cap = self.spec.final_logit_softcapping
        return cap * torch.tanh(logits / cap) if cap > 0 else logits

    def draft_tokens(self, hidden: torch.Tensor, vocab: int = 0) -> torch.Tensor:
        """The argmax of `logits(hidden)` over the first `vocab` token ids (0: all): a draft's token, reading only
        those rows of the head (soft-capping keeps the order, so it is left out)."""
        if not vocab:
            return self.logits(hidden).argmax(dim=-1)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, head[:vocab]).argmax(dim=-1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pools: Pools) -> torch.Tensor:
        """float32 logits [len(batch.logits_rows), vocab]: one row per request that samples."""
        hidden = self.hidden_states(batch, pools)
        return self.logits(hidden[batch.logits_rows])

    @torch.inference_mode()
    def forward_all_logits(self, batch: ForwardBatch, pools: Pools) -> torch.Tensor:
        """float32 logits of every new token, [T, vocab] (tests, prompt logprobs)."""
        return self.logits(self.hidden_states(batch, pools))
