"""The feed-forward blocks: a dense SwiGLU MLP (mlp_only layers, shared experts) and the routed
MoE block, which only reaches its routed experts through the ExpertStore."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferry.services.worker.experts import ExpertStore
from ferry.plan.model_config import ModelSpec


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden, intermediate, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    """softmax over all experts (float32), keep the top k, optionally renormalise them to sum to 1.

    Renormalised, that is exp(l_i) / sum over the top k of exp(l_j): a softmax over the top-k
    logits alone, which is how it is computed (top-k, softmax, cast: 3 kernels instead of 5;
    softmax is monotonic, so the same experts are picked). Equal up to float rounding."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device=None):
        super().__init__()
        self.top_k = spec.num_experts_per_tok
        self.norm_topk_prob = spec.norm_topk_prob
        self.weight = nn.Parameter(
            torch.zeros(spec.num_experts, spec.hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        if self.norm_topk_prob:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=torch.float32)
        else:
            weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        return ids, weights.to(logits.dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, moe_layer: int, experts: ExpertStore, dtype: torch.dtype, device=None):
        super().__init__()
        self.moe_layer = moe_layer  # index of this layer among the MoE layers: the store's key
        self.gate = TopKRouter(spec, dtype, device)
        # a plain reference, never a registered submodule: the store's slots are not this model's parameters
        object.__setattr__(self, "experts", experts)
        self.shared_expert = None
        if spec.shared_expert_intermediate_size > 0:
            self.shared_expert = DenseMLP(spec.hidden_size, spec.shared_expert_intermediate_size, dtype, device)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """`ctx` (the step's StepContext) tells the store how many rows are real (a CUDA graph's
        batch is padded to its size)."""
        ids, weights = self.gate(x)
        out = self.experts.forward(self.moe_layer, x, ids, weights, n_rows=ctx.batch.real_tokens if ctx else None)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
