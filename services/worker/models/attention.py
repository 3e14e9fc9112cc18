"""Full (softmax) attention over the paged KV pool.

q/k get a per-head RMSNorm before RoPE; the new tokens' K/V are written to their pages first,
then every new token attends causally to its request's context and new tokens, read through the
request's page table (so a request only ever touches rows of its own pages). Hybrid models
(`attn_output_gate`) have q_proj yield, per head, the query followed by a gate, and multiply the
attention output by sigmoid(gate) before o_proj."""

from __future__ import annotations

import torch
from torch import nn

from kernels.paged_attention import paged_attention, write_kv
from services.worker.models.context import StepContext
from services.worker.models.norms import make_norm
from services.worker.models.rotary import RotaryEmbedding
from shared.model_config import ModelSpec


class PagedAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
        self.gated = spec.attn_output_gate
        self.scale = self.head_dim**-0.5
        self.rotary = rotary
        h, bias = spec.hidden_size, spec.attention_bias
        q_out = self.heads * self.head_dim * (2 if self.gated else 1)
        kw = dict(dtype=dtype, device=device)
        self.q_proj = nn.Linear(h, q_out, bias=bias, **kw)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias, **kw)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias, **kw)
        self.q_norm = make_norm(spec.is_hybrid, self.head_dim, spec.rms_norm_eps, dtype, device)
        self.k_norm = make_norm(spec.is_hybrid, self.head_dim, spec.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(t, self.heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            gate = gate.reshape(t, -1)
        q = self.q_norm(q.reshape(t, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        q = self.rotary.apply(q, ctx.cos, ctx.sin)
        k = self.rotary.apply(k, ctx.cos, ctx.sin)

        b = ctx.batch
        k_cache, v_cache = ctx.pools.kv.layer(self.layer_idx)
        write_kv(k_cache, v_cache, b.slot_mapping, k, v)
        out = paged_attention(
            q.contiguous(), k_cache, v_cache, b.page_table, b.query_start, b.positions,
            b.query_lens_host, b.context_lens_host, self.scale,
        ).reshape(t, -1)  # fmt: skip
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
