"""One decoder layer (pre-norm token mixer + pre-norm MLP, both residual) and the causal LM."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ferry.kernels.expert_rows_sum import ExpertRows
from ferry.plan.model_config import LINEAR_ATTENTION, ModelSpec
from ferry.services.worker.forward_batch import ForwardBatch
from ferry.services.worker.models.attention import PagedAttention
from ferry.services.worker.models.context import StepContext
from ferry.services.worker.models.gated_deltanet import GatedDeltaNet
from ferry.services.worker.models.mlp import DenseMLP, SparseMoeBlock
from ferry.services.worker.models.norms import make_norm
from ferry.services.worker.models.rotary import RotaryEmbedding
from ferry.services.worker.models.weights import checkpoint_shapes, load_checkpoint_weights
from ferry.services.worker.offload.stores.expert_store import ExpertStore
from ferry.services.worker.pools import Pools


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer_idx: int,
        rotary: RotaryEmbedding,
        experts: ExpertStore,
        dtype: torch.dtype,
        device=None,
    ):
        super().__init__()
        self.is_linear = spec.layer_types[layer_idx] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(spec, layer_idx, dtype, device)
        else:
            self.self_attn = PagedAttention(spec, layer_idx, rotary, dtype, device)
        if spec.moe_layers[layer_idx]:
            moe_layer = spec.moe_layer_indices.index(layer_idx)
            self.mlp = SparseMoeBlock(spec, moe_layer, experts, dtype, device)
        else:
            self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, dtype, device)
        self._moe = spec.moe_layers[layer_idx]
        self.input_layernorm = make_norm(spec.is_hybrid, spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = make_norm(spec.is_hybrid, spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(
        self, x: torch.Tensor | ExpertRows, residual: torch.Tensor | None, ctx: StepContext
    ) -> tuple[torch.Tensor | ExpertRows, torch.Tensor]:
        """The layer's input is residual + x (x alone for the first layer, residual None); returns
        (mlp output, residual), the add left to the next norm. Each residual add is thus fused
        into the RMSNorm after it (one kernel on CUDA instead of two); the sums are the same. A MoE
        block's output may be its routed experts' unsummed rows (ExpertRows): that norm sums them."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h, residual = self.post_attention_layernorm.forward_add(ctx.mix(mixer, h), residual)
        return (self.mlp(h, ctx, summed=False) if self._moe else self.mlp(h, ctx)), residual


class CausalLM(nn.Module):
    """qwen3_moe, qwen3_next and qwen3_5_moe (text): which layers exist follows the spec.

    Parameter names mirror the checkpoints' (without the `model.` prefix), so `load_weights`
    maps most tensors by name; see weights.py for the rest."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device, experts: ExpertStore):
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        object.__setattr__(self, "experts", experts)  # not a submodule: see SparseMoeBlock
        self.rotary = RotaryEmbedding(spec.head_dim, spec.partial_rotary_factor, spec.rope_theta, device)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, self.rotary, experts, dtype, device) for i in range(spec.num_layers)
        )
        self.norm = make_norm(spec.is_hybrid, spec.hidden_size, spec.rms_norm_eps, dtype, device)
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
        cos, sin = self.rotary.cos_sin(batch.positions, self.dtype)
        ctx = StepContext.of(batch, pools, cos, sin, bool(self.spec.linear_attention_layers))
        x, residual = self.embed_tokens(batch.tokens), None
        for layer in self.layers:
            x, residual = layer(x, residual, ctx)
        return self.norm(x) if residual is None else self.norm.forward_add(x, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, head).float()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pools: Pools) -> torch.Tensor:
        """float32 logits [len(batch.logits_rows), vocab]: one row per request that samples."""
        hidden = self.hidden_states(batch, pools)
        return self.logits(hidden[batch.logits_rows])

    @torch.inference_mode()
    def forward_all_logits(self, batch: ForwardBatch, pools: Pools) -> torch.Tensor:
        """float32 logits of every new token, [T, vocab] (tests, prompt logprobs)."""
        return self.logits(self.hidden_states(batch, pools))
