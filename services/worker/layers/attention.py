"""Full (softmax) attention over the paged KV pool.

q/k get a per-head RMSNorm before RoPE (where the spec's `qk_norm`); the new tokens' K/V are written
to their pages first, then every new token attends causally to its request's context and new tokens, read through the
request's page table (so a request only ever touches rows of its own pages). Hybrid models
(`attn_output_gate`) have q_proj yield, per head, the query followed by a gate, and multiply the
attention output by sigmoid(gate) before o_proj.

q, k and v are row blocks of one weight (q_proj/k_proj/v_proj keep their checkpoint names as
views of it), so the three projections are one GEMM. On CUDA the q/k norms, the rotary embedding and the K/V write are
one Triton kernel (kernels/qk_norm_rope.py); the torch code below is the CPU path and that kernel's twin, and without
q/k norms the path on every device (the kernel always normalises). An fp8 KV pool
(--kv-cache-dtype fp8) hands both the layer's scales: the writes quantize, the attention dequantizes.

gpt-oss adds a learned sink logit per head to each softmax's denominator (`sinks`, where the spec's
`attention_sinks`) and, in its sliding layers, attends to the last `attention_window(layer)` keys only. Both
are computed by the paged kernels and their twin (kernels/paged_attention*.py); FlashAttention does not take
them, so such a layer's long prefills go through the blocked Triton kernel. A sliding layer whose group keeps
rings (plan/kv_groups.py) writes and reads its K/V in the ring of each request's slot (`state_slots`), not
through the page table, over a step in sliding slices (StepContext.mix), each written and attended before the
next.

Gemma 4's layers differ in head size and KV heads (the spec's `layer_head_dim` / `layer_kv_heads`) and rotary
embedding (each layer's own `rotary`, its tables in the step's context); in its full layers V is k_proj's output
(`value_is_key`: no v_proj), every V gets an RMSNorm without a weight (`value_norm`), and the q/k norms make
the softmax's scale 1 (`attention_scale`)."""

from __future__ import annotations

import torch
from torch import nn

from ferry.kernels.dense_gemv import dense_linear
from ferry.kernels.dispatch import use_triton
from ferry.kernels.kv_ring import ring_rows
from ferry.kernels.paged_attention import paged_attention, write_kv
from ferry.kernels.qk_norm_rope import qk_norm_rope_kv_triton
from ferry.kernels.rms_norm_reference import rms_normalise
from ferry.plan.model_config import ModelSpec
from ferry.services.worker.layers.context import StepContext
from ferry.services.worker.layers.norms import make_norm
from ferry.services.worker.layers.rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, rotary: RotaryEmbedding, dtype: torch.dtype, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = spec.num_attention_heads
        self.kv_heads, self.head_dim = spec.layer_kv_heads(layer_idx), spec.layer_head_dim(layer_idx)
        self.gated = spec.attn_output_gate
        self.scale = spec.attention_scale or self.head_dim**-0.5
        self.rotary = rotary
        h, bias = spec.hidden_size, spec.attention_bias
        q_out = self.heads * self.head_dim * (2 if self.gated else 1)
        kw = dict(dtype=dtype, device=device)
        kv_out = self.kv_heads * self.head_dim
        self.value_is_key = spec.value_is_key(layer_idx)  # no v_proj: V is k_proj's output
        self._splits = (q_out, kv_out) if self.value_is_key else (q_out, kv_out, kv_out)
        self._qkv_weight, self._qkv_bias, projections = row_blocks_of_one_weight(h, self._splits, bias, dtype, device)
        self.q_proj, self.k_proj = projections[:2]
        if not self.value_is_key:
            self.v_proj = projections[2]
        self.value_norm_eps = spec.rms_norm_eps if spec.value_norm else None
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=spec.attention_output_bias, **kw)
        self.window = spec.attention_window(layer_idx)
        self.sinks = None
        if spec.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(self.heads, **kw), requires_grad=False)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = make_norm(spec.zero_centered_norms, self.head_dim, spec.rms_norm_eps, dtype, device)
            self.k_norm = make_norm(spec.zero_centered_norms, self.head_dim, spec.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = dense_linear(x, self._qkv_weight, self._qkv_bias).split(self._splits, dim=-1)
        q, k, v = (*qkv, qkv[1]) if self.value_is_key else qkv
        gate = None
        if self.gated:
            q, gate = q.view(t, self.heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            gate = gate.reshape(t, -1)
        q = q.reshape(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if self.value_norm_eps is not None:  # an RMSNorm without a weight, each head's values
            v = rms_normalise(v, self.value_norm_eps).to(v.dtype)
        cos, sin = ctx.rotary_table(self.rotary.table_index)
        b = ctx.batch
        k_cache, v_cache = ctx.pools.kv.layer(self.layer_idx)
        k_scale, v_scale = ctx.pools.kv.layer_scales(self.layer_idx)  # None, None but in an fp8 pool
        ring = ctx.pools.kv.ring_pages(self.layer_idx)
        slot_mapping = b.slot_mapping
        if ring:  # a sliding group's rings: the rows of the tokens' request slots, not of the page table
            # more of a request's tokens than the ring holds besides the window would overwrite keys still read
            if max(b.query_lens_host) > ctx.pools.kv.slice_tokens(self.layer_idx):
                raise ValueError(
                    f"layer {self.layer_idx}'s rings hold {ctx.pools.kv.slice_tokens(self.layer_idx)} new tokens a "
                    f"request, the step gives {max(b.query_lens_host)}: run it in sliding slices (StepContext.mix)"
                )
            slot_mapping = ring_rows(b.positions, b.state_slots[b.token_request.long()], ring, b.page_size)
        if use_triton(x) and self.q_norm is not None:
            norm = self.q_norm
            q = qk_norm_rope_kv_triton(
                q,
                k,
                v,
                norm.weight,
                self.k_norm.weight,
                norm.eps,
                norm.zero_centered,
                cos,
                sin,
                self.rotary.rotary_dim,
                slot_mapping,
                k_cache,
                v_cache,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = self.rotary.apply(q, cos, sin)
            k = self.rotary.apply(k, cos, sin)
            write_kv(k_cache, v_cache, slot_mapping, k, v, k_scale, v_scale)
        out = attend_paged(
            q,
            k_cache,
            v_cache,
            b,
            self.scale,
            ctx.pools.kv.gather_for(self.layer_idx),
            k_scale,
            v_scale,
            sinks=self.sinks,
            window=self.window,
            ring_pages=ring,
            ring_slots=b.state_slots if ring else None,
        ).reshape(t, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return dense_linear(out, self.o_proj.weight, self.o_proj.bias)


def attend_paged(q, k_cache, v_cache, b, scale: float, gather, k_scale=None, v_scale=None, **options) -> torch.Tensor:
    """The paged kernels (kernels/paged_attention.py) for the queries `q` of step batch `b` (a ForwardBatch: its
    pages, positions and lengths) over one layer's K/V, already written; `options`: the kernel's sinks, window and
    ring arguments. Every paged layer (the MTP head's too) reads the batch the same way, through here."""
    return paged_attention(
        q.contiguous(),
        k_cache,
        v_cache,
        b.page_table,
        b.query_start,
        b.positions,
        b.query_lens_host,
        b.context_lens_host,
        scale,
        token_request=b.token_request,
        gather=gather,
        k_scale=k_scale,
        v_scale=v_scale,
        **options,
    )


def row_blocks_of_one_weight(in_features: int, outs: tuple[int, ...], bias: bool, dtype, device):
    """(weight [sum(outs), in], bias or None, one nn.Linear per block whose parameters are views
    of those rows): the loader fills the blocks by their own names, the forward multiplies once."""
    weight = torch.empty(sum(outs), in_features, dtype=dtype, device=device)
    fused_bias = torch.zeros(sum(outs), dtype=dtype, device=device) if bias else None
    linears, start = [], 0
    for n in outs:
        linear = nn.Linear(in_features, n, bias=bias, device="meta")
        linear.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias:
            linear.bias = nn.Parameter(fused_bias[start : start + n], requires_grad=False)
        linears.append(linear)
        start += n
    return weight, fused_bias, linears
