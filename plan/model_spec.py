"""A model's architecture as the planner, the loader and the models see it: one frozen object.

A family's config reader (plan/model_families/) fills it from config.json (plan/model_config.py);
every field is a fact of the model, never a family name to branch on (`arch` names the family: the
registries find its parts by it, messages name it).
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ferry.plan.quantization import QuantScheme

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
# the routed experts' activation on (gate, up): silu(gate) * up, or gpt-oss's clamped SwiGLU
# (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit)
SILU = "silu"
CLAMPED_SWIGLU = "clamped_swiglu"
# gelu(gate, tanh approximation) * up: Gemma's experts and dense MLPs (transformers' gelu_pytorch_tanh)
GELU_TANH = "gelu_tanh"


@dataclass(frozen=True)
class LayerRope:
    """One attention layer's rotary embedding where layers differ (Gemma 4: its sliding and full layers).
    `proportional` (rope_type "proportional"): the frequencies are theta^(-2i / head_dim) for the first
    `partial_rotary_factor * head_dim / 2` pairs and 0 for the rest, and the pairs are (i, i + head_dim / 2)
    across the whole head (transformers' `_compute_proportional_rope_parameters`); otherwise the first
    `partial_rotary_factor` of the head turns, theta^(-2i / rotary_dim)."""

    theta: float
    partial_rotary_factor: float = 1.0
    proportional: bool = False


@dataclass(frozen=True)
class YarnRope:
    """YaRN rotary scaling (rope_type "yarn"): frequencies blended between the original and the
    interpolated ones by a ramp over the dimensions, cos/sin multiplied by `attention_factor`
    (None: 0.1 ln(factor) + 1), as transformers' `_compute_yarn_parameters` computes them."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything the planner, the loader and the models need to know about an architecture."""

    arch: str  # the model family's name (plan/model_families): qwen3_moe | qwen3_next | glm4_moe | gpt_oss ...
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # FULL_ATTENTION | LINEAR_ATTENTION per layer
    moe_layers: tuple[bool, ...]  # True where the layer's MLP is the routed MoE block
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    dtype: str  # the checkpoint's dtype
    # full attention
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool  # q_proj, k_proj and v_proj have biases
    attn_output_gate: bool  # q_proj also yields a sigmoid gate on the attention output
    rope_theta: float
    partial_rotary_factor: float
    # MLPs
    intermediate_size: int  # dense MLP layers (mlp_only_layers), 0 when there are none
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    attention_output_bias: bool = False  # o_proj has a bias (Qwen's with attention_bias; GLM's never)
    rope_yarn: YarnRope | None = None  # None: plain RoPE
    # a learned logit per head in each softmax's denominator (`self_attn.sinks`): a share of the
    # attention that goes to no key
    attention_sinks: bool = False
    # per layer, the keys a token attends to in a sliding-window layer (itself and the window - 1 before it),
    # 0 for a layer that attends to its whole context; () every layer does
    attention_windows: tuple[int, ...] = ()
    # per layer, where attention layers differ in shape: its kv heads and head_dim (); every layer has
    # num_kv_heads and head_dim
    attention_kv_heads: tuple[int, ...] = ()
    attention_head_dims: tuple[int, ...] = ()
    qk_norm: bool = True  # a per-head RMSNorm on q and k before the rotary embedding
    # the router: "softmax" over all experts, or "sigmoid" of each logit (with, where router_score_bias,
    # a per-expert bias added for choosing the top k only: the weights are the unbiased scores)
    router_scoring: str = "softmax"
    router_score_bias: bool = False
    # group-limited routing: experts split into router_groups groups, the top k chosen among the
    # router_topk_groups groups whose two best scores sum highest
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights
    shared_expert_gate: bool = True  # the shared expert's output is scaled by sigmoid(its gate logit)
    router_bias: bool = False  # the router's linear has a bias (added to the logits before the top k)
    # the routed experts' projections have biases (gate/up and down), which travel with the expert
    expert_bias: bool = False
    expert_activation: str = SILU  # SILU | CLAMPED_SWIGLU (with swiglu_alpha and swiglu_limit) | GELU_TANH
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    # per attention layer where layers differ (Gemma 4's sliding and full layers), else (): whether its values are
    # its keys' projection (no v_proj: `attention_k_eq_v`), its rotary embedding
    layer_value_is_key: tuple[bool, ...] = ()
    layer_ropes: tuple[LayerRope, ...] = ()
    value_norm: bool = False  # V gets an RMSNorm without a weight before it is cached (Gemma 4's v_norm)
    attention_scale: float = 0.0  # the softmax's q.k scale; 0: head_dim ** -0.5 (Gemma 4's normed q/k: 1.0)
    mlp_activation: str = SILU  # the dense MLPs' (and shared expert's): SILU | GELU_TANH
    # every MoE layer also has a dense MLP of `intermediate_size` beside its experts, each output with its own
    # norms (Gemma 4's enable_moe_block)
    moe_beside_dense_mlp: bool = False
    embedding_multiplier: float = 1.0  # the token embeddings are multiplied by it (rounded to the dtype)
    final_logit_softcapping: float = 0.0  # logits -> cap * tanh(logits / cap) where positive
    # multi-token-prediction layers the checkpoint stores after the decoder's (layers.N.… for N at and past
    # num_layers): not served, neither loaded nor priced
    mtp_layers: int = 0
    # multi-token-prediction draft layers stored under `mtp.` (Qwen3.5/3.6, Qwen3-Next: plan/mtp_layer.py): what
    # `--speculative-method mtp` drafts with; `mtp_dedicated_embeddings`: they embed with their own table
    mtp_draft_layers: int = 0
    mtp_dedicated_embeddings: bool = False
    # the MTP draft layers whose K/V the KV pool holds, as layers num_layers .. num_layers + mtp_kv_layers - 1 of
    # the full-attention group (plan/kv_groups.py): the one that drafts when drafting with MTP (plan/mtp_layer.py's
    # `drafting_spec`), else 0
    mtp_kv_layers: int = 0
    # Gated DeltaNet (linear attention); zeros where no layer is linear attention
    linear_conv_kernel_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # every RMSNorm but the Gated DeltaNet's output norm computes x * (1 + w): its identity weight is zero
    zero_centered_norms: bool = False
    # the checkpoint's quantization (plan/quantization.py); None: unquantized
    quantization: QuantScheme | None = None
    text_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    def value_is_key(self, layer: int) -> bool:
        """Layer `layer`'s values are its keys' projection (before the k norm and the rotary embedding)."""
        return bool(self.layer_value_is_key) and self.layer_value_is_key[layer]

    def attention_window(self, layer: int) -> int:
        """The keys a token of `layer` attends to, itself included; 0: its whole context."""
        return self.attention_windows[layer] if self.attention_windows else 0

    def layer_kv_heads(self, layer: int) -> int:
        return self.attention_kv_heads[layer] if self.attention_kv_heads else self.num_kv_heads

    def layer_head_dim(self, layer: int) -> int:
        return self.attention_head_dims[layer] if self.attention_head_dims else self.head_dim

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def moe_layer_indices(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.moe_layers) if m)

    @property
    def total_experts(self) -> int:
        return len(self.moe_layer_indices) * self.num_experts

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv1d: q, k and v of the Gated DeltaNet."""
        return 2 * self.linear_key_dim + self.linear_value_dim
