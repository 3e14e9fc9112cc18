"""The multi-token-prediction (MTP) draft head of Qwen3.5/3.6, Qwen3-Next and GLM-4.x: what
`--speculative-method mtp` drafts with. Its tensors, where each family stores them, and their cost:
plan/mtp_layer.py.

Given the target's final-normed hidden state h_t at position t and the embedding e of token t + 1 (the target's
embedding table), the head computes fc(cat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h_t))) (embedding first,
as the checkpoints' fc is trained), runs it through its own full-attention MoE decoder layer at position t + 1
(attention over the head's own keys and values of the earlier positions), normalises it with its `norm`, and the
target's head turns that into the logits of token t + 2. Its output hidden state stands in for h_{t+1} to draft
the next token. Its layer is built as the target's full-attention MoE layers are (the spec says): Qwen's norms
zero-centred, its attention gated with q/k norms, its router softmax with a gated shared expert; GLM's norms plain,
its attention with q/k/v biases, its router sigmoid over expert groups with an ungated shared expert.

Without a cache the layer attends within the positions it is given (a causal mask over them): its keys and values
are computed from the same sequence (the reference the tests hold the cached path to). With one (`MtpCache`: the
MTP layer's K/V in the KV pool, plan/kv_groups.py) the new tokens' K/V are written at the batch's slots and each
token attends over its request's pages, as the target's full-attention layers do (services/worker/mtp_drafts.py
says which slot holds which position). Its routed experts are resident parameters, stacked as gate_up
[E, 2I, H] and down [E, H, I] (plan/mtp_layer.py says why they are not in the target's slot cache)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ferry.kernels.dense_gemv import dense_linear
from ferry.kernels.dispatch import use_triton
from ferry.kernels.grouped_expert_gemm import grouped_expert_forward
from ferry.kernels.paged_attention import write_kv
from ferry.kernels.qk_norm_rope import qk_norm_rope_kv_triton
from ferry.kernels.router_topk_reference import router_topk_reference, sigmoid_topk_reference
from ferry.plan.model_spec import ModelSpec
from ferry.plan.mtp_layer import MTP_PREFIX, check_mtp, mtp_expert_shapes, mtp_name, mtp_resident_weight_shapes
from ferry.services.worker.checkpoint import iter_checkpoint_tensors
from ferry.services.worker.layers.attention import attend_paged, row_blocks_of_one_weight
from ferry.services.worker.layers.norms import make_norm
from ferry.services.worker.layers.rotary import RotaryEmbedding
from ferry.services.worker.models.weights import WeightLoadError
from ferry.services.worker.quantized_weight import QuantizedWeight

_PER_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def _frozen_linear(inputs: int, outputs: int, dtype: torch.dtype, device, bias: bool = False) -> nn.Linear:
    linear = nn.Linear(inputs, outputs, bias=bias, dtype=dtype, device=device)
    linear.requires_grad_(False)
    return linear


@dataclass(frozen=True)
class MtpCache:
    """Where an MTP layer keeps its keys and values: its layer of the KV pool (plan/mtp_layer.py's `mtp_kv_layer`)
    and the batch of slots its tokens sit at (`batch.positions`: each token's slot in its request's pages)."""

    kv: object  # services/worker/pools.py's KvTensorPool
    layer: int
    batch: object  # services/worker/forward_batch.py's ForwardBatch


class MtpAttention(nn.Module):
    """Full attention as the target's full-attention layers (the spec says): where `attn_output_gate`, q_proj
    yields each head's query and then its sigmoid gate; per-head q/k norms where `qk_norm`; q/k/v biases where
    `attention_bias`; the rotary embedding turns the first `rotary_dim` channels; keys and values shared by groups
    of query heads."""

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, dtype: torch.dtype, device):
        super().__init__()
        h, self.heads, self.kv_heads = spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads
        self.head_dim, self.gated = spec.head_dim, spec.attn_output_gate
        self.scale = spec.attention_scale or self.head_dim**-0.5
        self.rotary = rotary
        q_out = self.heads * self.head_dim * (2 if self.gated else 1)
        kv_out, bias = self.kv_heads * self.head_dim, spec.attention_bias
        # q, k and v one weight (a step multiplies once, as the target's attention); a K/V write multiplies its
        # key and value rows alone
        self._splits = (q_out, kv_out, kv_out)
        self._qkv_weight, self._qkv_bias, projections = row_blocks_of_one_weight(h, self._splits, bias, dtype, device)
        self.q_proj, self.k_proj, self.v_proj = projections
        self._kv_weight = self._qkv_weight[q_out:]
        self._kv_bias = None if self._qkv_bias is None else self._qkv_bias[q_out:]
        self.o_proj = _frozen_linear(self.heads * self.head_dim, h, dtype, device, spec.attention_output_bias)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = make_norm(spec.zero_centered_norms, self.head_dim, spec.rms_norm_eps, dtype, device)
            self.k_norm = make_norm(spec.zero_centered_norms, self.head_dim, spec.rms_norm_eps, dtype, device)

    def write(self, x: torch.Tensor, positions: torch.Tensor, cache: MtpCache) -> None:
        """Only write the keys and values of `x` at the cache's slots: what a later query there attends to."""
        t = x.shape[0]
        k, v = dense_linear(x, self._kv_weight, self._kv_bias).view(t, 2, self.kv_heads, self.head_dim).unbind(1)
        self._turn_and_write(None, k, v, *self.rotary.cos_sin(positions, x.dtype), cache)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: MtpCache | None = None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = dense_linear(x, self._qkv_weight, self._qkv_bias).split(self._splits, dim=-1)
        q, gate = q.view(t, self.heads, -1), None
        if self.gated:
            q, gate = q.split(self.head_dim, dim=-1)
            gate = gate.reshape(t, -1)
        k, v = k.view(t, self.kv_heads, self.head_dim), v.view(t, self.kv_heads, self.head_dim)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        if cache is not None:
            q = self._turn_and_write(q, k, v, cos, sin, cache)
            k_cache, v_cache = cache.kv.layer(cache.layer)
            k_scale, v_scale = cache.kv.layer_scales(cache.layer)  # None, None but in an fp8 pool
            gather = cache.kv.gather_for(cache.layer)
            out = attend_paged(q, k_cache, v_cache, cache.batch, self.scale, gather, k_scale, v_scale)
        else:
            q, k = self._turned(q, cos, sin, self.q_norm), self._turned(k, cos, sin, self.k_norm)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1),
                k.transpose(0, 1),
                v.transpose(0, 1),
                attn_mask=positions[None, :] <= positions[:, None],  # each position sees itself and earlier ones
                scale=self.scale,
                enable_gqa=True,
            ).transpose(0, 1)
        out = out.reshape(t, -1)
        return dense_linear(out if gate is None else out * torch.sigmoid(gate), self.o_proj.weight, self.o_proj.bias)

    def _turned(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm) -> torch.Tensor:
        return self.rotary.apply(x if norm is None else norm(x), cos, sin)

    def _turn_and_write(self, q, k, v, cos, sin, cache: MtpCache) -> torch.Tensor | None:
        """Norm and turn q (None: no queries) and k, write k and v at the cache's slots; q turned. With q/k norms on
        the Triton path one launch (kernels/qk_norm_rope.py, as the target's attention), else its torch twin."""
        k_cache, v_cache = cache.kv.layer(cache.layer)
        k_scale, v_scale = cache.kv.layer_scales(cache.layer)  # None, None but in an fp8 pool
        norm = self.k_norm
        if norm is not None and use_triton(k):
            return qk_norm_rope_kv_triton(
                k[:, :0] if q is None else q,  # no query heads: the kernel writes the keys and values alone
                k,
                v,
                norm.weight if q is None else self.q_norm.weight,
                norm.weight,
                norm.eps,
                norm.zero_centered,
                cos,
                sin,
                self.rotary.rotary_dim,
                cache.batch.slot_mapping,
                k_cache,
                v_cache,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        write_kv(k_cache, v_cache, cache.batch.slot_mapping, self._turned(k, cos, sin, norm), v, k_scale, v_scale)
        return None if q is None else self._turned(q, cos, sin, self.q_norm)


class MtpMoe(nn.Module):
    """The target's MoE block (the spec says), its routed experts resident: the router (kernels/
    router_topk_reference.py: softmax, or sigmoid with the score bias and expert groups) chooses the top k and
    weighs them, the chosen experts' SwiGLU outputs weighted, plus the shared expert's, scaled by
    sigmoid(shared_expert_gate) where the spec gates it."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device):
        super().__init__()
        h, e, i = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
        si = spec.shared_expert_intermediate_size
        self.spec, self.intermediate = spec, i
        self.gate = _frozen_linear(h, e, dtype, device, spec.router_bias)
        if spec.router_score_bias:  # float32, as the checkpoints store it: it decides between close scores
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(e, dtype=torch.float32, device=device), requires_grad=False
            )
        self.gate_up = nn.Parameter(torch.zeros(e, 2 * i, h, dtype=dtype, device=device), requires_grad=False)
        self.down = nn.Parameter(torch.zeros(e, h, i, dtype=dtype, device=device), requires_grad=False)
        self.shared_expert = self.shared_expert_gate = None
        if si:
            self.shared_expert = nn.Module()
            self.shared_expert.gate_proj = _frozen_linear(h, si, dtype, device)
            self.shared_expert.up_proj = _frozen_linear(h, si, dtype, device)
            self.shared_expert.down_proj = _frozen_linear(si, h, dtype, device)
            if spec.shared_expert_gate:
                self.shared_expert_gate = _frozen_linear(h, 1, dtype, device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their weights [T, k] in x's dtype), as the target's router's reference computes them."""
        spec, gate = self.spec, self.gate
        if spec.router_scoring == "sigmoid":
            bias = None if gate.bias is None else gate.bias.float()
            return sigmoid_topk_reference(
                F.linear(x.float(), gate.weight.float(), bias),
                spec.num_experts_per_tok,
                spec.norm_topk_prob,
                getattr(gate, "e_score_correction_bias", None),
                spec.router_groups,
                spec.router_topk_groups,
                spec.routed_scaling_factor,
                x.dtype,
            )
        ids, weights, _ = router_topk_reference(
            gate(x), spec.num_experts_per_tok, spec.norm_topk_prob, spec.num_experts
        )
        return ids, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        # the target's expert kernels (the stacked experts are their [E, 2I, H] / [E, H, I] banks, an expert's id its
        # slot): a chain position's few (token, k) pairs in two launches, no host round trip, as a graph can hold
        out = grouped_expert_forward(x, ids, weights.float(), self.gate_up, self.down)
        s = self.shared_expert
        if s is None:
            return out
        shared = s.down_proj(F.silu(s.gate_proj(x)) * s.up_proj(x))
        return out + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared)


class MtpLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, dtype: torch.dtype, device):
        super().__init__()
        norm = (spec.zero_centered_norms, spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.input_layernorm = make_norm(*norm)
        self.self_attn = MtpAttention(spec, rotary, dtype, device)
        self.post_attention_layernorm = make_norm(*norm)
        self.mlp = MtpMoe(spec, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: MtpCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MtpHead(nn.Module):
    """The `mtp.` tensors as a module (parameter names are the checkpoint's without `mtp.`, the experts stacked)."""

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, dtype: torch.dtype, device=None):
        super().__init__()
        check_mtp(spec)
        h = spec.hidden_size
        self.spec = spec
        norm = (spec.zero_centered_norms, h, spec.rms_norm_eps, dtype, device)
        self.fc = _frozen_linear(2 * h, h, dtype, device)
        self.pre_fc_norm_embedding = make_norm(*norm)
        self.pre_fc_norm_hidden = make_norm(*norm)
        self.layers = nn.ModuleList(MtpLayer(spec, rotary, dtype, device) for _ in range(spec.mtp_draft_layers))
        self.norm = make_norm(*norm)
        self.draft_vocab = 0  # --speculative-draft-vocab: drafts among the first N token ids (0: all)

    def forward(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        positions: torch.Tensor,
        layer: int = 0,
        cache: MtpCache | None = None,
    ) -> torch.Tensor:
        """The head's final-normed hidden states [T, H] (the target's head makes them the draft logits): row j
        from the target's hidden state at position positions[j] - 1 and the embedding of the token at
        positions[j], through MTP layer `layer`; with `cache`, attending over the layer's K/V in the pool."""
        return self.norm(self.layers[layer](self._layer_input(hidden, next_embeds), positions, cache))

    def write_kv(
        self, hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor, cache: MtpCache, layer: int = 0
    ) -> None:
        """Only write MTP layer `layer`'s keys and values of these rows (as `forward` takes them) into `cache`: they
        depend on the layer's input alone, not on its attention or experts, so keeping the layer's K/V for every
        position costs the fc and two projections, and the whole layer runs only where a draft is made."""
        layer_ = self.layers[layer]
        layer_.self_attn.write(layer_.input_layernorm(self._layer_input(hidden, next_embeds)), positions, cache)

    def _layer_input(self, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        normed = torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        return dense_linear(normed, self.fc.weight)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the checkpoint's `mtp.` tensors (name, tensor), experts per expert or fused; a WeightLoadError
        names a missing, unexpected or misshapen one."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in tensors:
            if not name.startswith(MTP_PREFIX):
                raise WeightLoadError(f"checkpoint tensor {name!r} is not an MTP tensor (mtp.…)")
            target, rows, keys = self._destination(name.removeprefix(MTP_PREFIX))
            if target not in params:
                raise WeightLoadError(f"unexpected MTP tensor {name!r} in the checkpoint")
            param = params[target]
            dest = param.data if rows is None else param.data[rows]
            if isinstance(tensor, QuantizedWeight):  # dequantized once, as the target's dense weights
                tensor = tensor.dequantize(dest.dtype, dest.device)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise WeightLoadError(
                    f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.update(keys)
        expected = {**mtp_resident_weight_shapes(self.spec), **mtp_expert_shapes(self.spec)}
        missing = sorted(name for name in expected if name.removeprefix(MTP_PREFIX) not in loaded)
        if missing:
            raise WeightLoadError(f"the checkpoint lacks {len(missing)} MTP tensors, e.g. {missing[0]!r}")

    def _destination(self, name: str) -> tuple[str, tuple | None, tuple[str, ...]]:
        """(parameter, its rows or None for all of it, the per-expert-layout names it stands for) of one checkpoint
        tensor (its name without `mtp.`)."""
        m = _PER_EXPERT.fullmatch(name)
        if m is not None:
            layer, expert, proj = int(m[1]), int(m[2]), m[3]
            i = self.spec.moe_intermediate_size
            stacked = f"layers.{layer}.mlp.{'down' if proj == 'down' else 'gate_up'}"
            rows = {"gate": (expert, slice(0, i)), "up": (expert, slice(i, 2 * i)), "down": (expert,)}[proj]
            return stacked, rows, (name,)
        m = _FUSED.fullmatch(name)
        if m is not None:
            stacked = f"layers.{m[1]}.mlp.{m[2].removesuffix('_proj')}"
            projs = ("gate", "up") if m[2] == "gate_up_proj" else ("down",)
            covered = (
                f"layers.{m[1]}.mlp.experts.{e}.{p}_proj.weight" for e in range(self.spec.num_experts) for p in projs
            )
            return stacked, None, tuple(covered)
        return name, None, (name,)


def random_mtp_tensors(spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every `mtp.` tensor (experts per expert), random and a pure function of the seed: `--load-format dummy`'s
    and `ferry make-tiny-model --mtp`'s. Matrices ~N(0, 0.08) (the tiny models' init), norms ~N(0, 0.1) off
    their zero identity, so a swapped or skipped norm changes the output."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {**mtp_resident_weight_shapes(spec), **mtp_expert_shapes(spec)}
    tensors = {}
    for name in sorted(shapes):
        scale = 0.1 if name.endswith("norm.weight") else 0.08
        tensors[name] = (scale * torch.randn(shapes[name], generator=generator)).to(dtype)
    return tensors


def read_mtp_tensors(model_dir, spec: ModelSpec, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(`mtp.…` name, tensor) of the checkpoint's MTP tensors, wherever its family stores them (plan/mtp_layer.py's
    `mtp_name`; the target's passes skip them: plan/costs.py's `is_served`)."""
    selected = iter_checkpoint_tensors(model_dir, lambda name: mtp_name(spec, name) is not None, "mtp", progress)
    for name, tensor in selected:
        yield mtp_name(spec, name), tensor
