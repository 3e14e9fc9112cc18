"""Gated DeltaNet, the linear-attention token mixer of the hybrid models.

x -> in_proj -> [q k v | z | b | a]; q,k,v -> depthwise causal conv1d + SiLU (state: the last
kernel-1 inputs); beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias); gated delta rule
(state: [v_heads, k_dim, v_dim] float32); per-head RMSNorm gated by SiLU(z); out_proj.

Both states live in the request's LinearStatePool slot; a request's first chunk (`reset_state`)
zeroes them first, later chunks and decode steps continue from them. The input projection is one
matrix whose rows are [q | k | v | z | b | a] in head order (qwen3_5_moe's layout); checkpoints that
store it otherwise are permuted into it at load time by their family's weight-name map (qwen3_next's
per-key-head interleaved in_proj_qkvz / in_proj_ba: models/qwen3_hybrid.py), so one forward serves all.

A decode step on the Triton path (bf16/fp16) runs everything between in_proj and out_proj in two
launches (kernels/gated_deltanet_decode.py, ~35 kernels in torch + fla); prefill and chunked steps
run the conv in two (kernels/causal_conv1d.py) and fla's chunked rule, the CPU the torch composition,
which is also those kernels' twin. Neither reads anything back from the device."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from ferry.kernels.causal_conv1d import causal_conv1d_decode, causal_conv1d_varlen, conv_state_after
from ferry.kernels.dense_gemv import dense_linear
from ferry.kernels.dispatch import use_triton
from ferry.kernels.gated_delta_rule import gated_delta_rule_varlen_keeping
from ferry.kernels.gated_deltanet_decode import gated_deltanet_decode
from ferry.plan.model_config import ModelSpec
from ferry.services.worker.layers.context import StepContext
from ferry.services.worker.layers.norms import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.k_heads, self.v_heads = spec.linear_num_key_heads, spec.linear_num_value_heads
        self.k_dim, self.v_dim = spec.linear_key_head_dim, spec.linear_value_head_dim
        self.key_size, self.value_size = spec.linear_key_dim, spec.linear_value_dim
        self.conv_size = spec.linear_conv_dim
        kw = dict(dtype=dtype, device=device)
        # row blocks of in_proj, in order
        self.in_proj_parts = {
            "qkv": self.conv_size,
            "z": self.value_size,
            "b": self.v_heads,
            "a": self.v_heads,
        }
        self.in_proj = nn.Linear(spec.hidden_size, sum(self.in_proj_parts.values()), bias=False, **kw)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(
            torch.zeros(self.conv_size, 1, spec.linear_conv_kernel_dim, **kw), requires_grad=False
        )
        # the decay parameters stay float32 whatever the model dtype (as checkpoints store them):
        # rounding A_log to bf16 shifts every head's decay rate by up to 0.4%, compounded per token
        f32 = dict(dtype=torch.float32, device=device)
        self.A_log = nn.Parameter(torch.zeros(self.v_heads, **f32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads, **f32), requires_grad=False)
        self.norm = GatedRMSNorm(self.v_dim, spec.rms_norm_eps, dtype, device)
        self.out_proj = nn.Linear(self.value_size, spec.hidden_size, bias=False, **kw)

    def in_proj_rows(self, part: str) -> slice:
        start = 0
        for name, size in self.in_proj_parts.items():
            if name == part:
                return slice(start, start + size)
            start += size
        raise KeyError(part)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b = ctx.batch
        conv_states, recurrent_states = ctx.pools.linear_state.layer(self.layer_idx)
        if ctx.fresh_state_slots is not None:  # a stale slot may hold anything, NaN included: fill, don't scale
            conv_states.index_fill_(0, ctx.fresh_state_slots, 0)
            recurrent_states.index_fill_(0, ctx.fresh_state_slots, 0)

        t = x.shape[0]
        qkv, z, beta_logit, a = dense_linear(x, self.in_proj.weight).split(list(self.in_proj_parts.values()), dim=-1)
        conv_weight = self.conv1d.weight[:, 0, :]
        if t == b.num_requests and use_triton(x) and x.dtype in (torch.bfloat16, torch.float16):
            # a decode step on the GPU: conv, gates, rule and norm in two launches instead of ~35
            # (kernels/gated_deltanet_decode.py; its twin is the composition below)
            core = gated_deltanet_decode(
                qkv,
                z,
                beta_logit,
                a,
                conv_weight,
                self.A_log,
                self.dt_bias,
                self.norm.weight,
                self.norm.eps,
                conv_states,
                recurrent_states,
                b.state_slots,
                self.k_heads,
            )
            return dense_linear(core, self.out_proj.weight)
        inside = b.inside_saves if t != b.num_requests else ()
        if t == b.num_requests:  # one token per request: a decode step
            qkv = causal_conv1d_decode(qkv, conv_states, b.state_slots, conv_weight)
        else:
            slots = b.state_slots_host
            before = [conv_states[slots[row]].clone() for row, _, _ in inside]  # the conv states the chunks start from
            inputs = qkv
            qkv = causal_conv1d_varlen(
                qkv,
                conv_states,
                slots,
                b.query_lens_host,
                conv_weight,
                slots_on_device=b.state_slots,
                query_start=b.query_start,
            )
        q, k, v = qkv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        beta = torch.sigmoid(beta_logit)
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        core, kept = gated_delta_rule_varlen_keeping(
            q.reshape(t, self.k_heads, self.k_dim),
            k.reshape(t, self.k_heads, self.k_dim),
            v.reshape(t, self.v_heads, self.v_dim),
            g,
            beta,
            recurrent_states,
            b.state_slots,
            b.query_start,
            b.query_lens_host,
            [(row, n) for row, n, _ in inside],
            b.state_slots_host,
        )
        if inside:  # snapshots kept inside their rows' chunks (StepBatch.save_offset): this layer's part
            starts = [0, *itertools.accumulate(b.query_lens_host)]
            kernel = conv_weight.shape[1]
            for (row, n, snapshot), state, recurrent in zip(inside, before, kept):
                conv = conv_state_after(state, inputs[starts[row] : starts[row] + n], kernel)
                ctx.pools.linear_state.save_layer(self.layer_idx, snapshot, conv, recurrent)
        core = self.norm(core, z.reshape(t, self.v_heads, self.v_dim))
        return dense_linear(core.reshape(t, self.value_size), self.out_proj.weight)
