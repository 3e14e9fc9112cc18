"""Twin of kernels/gated_deltanet_decode.py: a Gated DeltaNet decode step between in_proj and
out_proj as the model composes it in torch (services/worker/layers/gated_deltanet.py, the path
CPU and prefill steps take): causal_conv1d_decode, beta = sigmoid(b) and
g = -exp(A_log) * softplus(a + dt_bias), the float32 recurrent rule request by request from its
slot, and the gated RMSNorm's twin (rms_norm_reference.py: GatedRMSNorm's CPU path). Same arguments
and contract as `gated_deltanet_decode`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.kernels.causal_conv1d_reference import causal_conv1d_decode
from ferry.kernels.gated_delta_rule_reference import gated_delta_rule_recurrent
from ferry.kernels.rms_norm_reference import gated_rms_norm_reference


def gated_deltanet_decode_reference(
    qkv,
    z,
    beta_logit,
    a,
    conv_weight,
    A_log,
    dt_bias,
    norm_weight,
    norm_eps,
    conv_states,
    states,
    state_slots,
    k_heads: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R, v_heads * v_dim] in qkv's dtype; conv_states and states updated in place (host reads: a twin)."""
    rows = qkv.shape[0]
    v_heads, k_dim, v_dim = states.shape[1:]
    key_size = k_heads * k_dim
    activated = causal_conv1d_decode(qkv, conv_states, state_slots, conv_weight)
    q, k, v = activated.split([key_size, key_size, v_heads * v_dim], dim=-1)
    beta = torch.sigmoid(beta_logit)
    g = -A_log.exp() * F.softplus(a.float() + dt_bias)
    core = torch.empty(rows, v_heads, v_dim, dtype=qkv.dtype, device=qkv.device)
    for r, slot in enumerate(state_slots.tolist()):
        o, final = gated_delta_rule_recurrent(
            q[r : r + 1].reshape(1, k_heads, k_dim),
            k[r : r + 1].reshape(1, k_heads, k_dim),
            v[r : r + 1].reshape(1, v_heads, v_dim),
            g[r : r + 1],
            beta[r : r + 1],
            states[slot],
        )
        core[r] = o[0].to(qkv.dtype)
        states[slot] = final
    result = gated_rms_norm_reference(core, z.reshape(rows, v_heads, v_dim), norm_weight, norm_eps)
    result = result.reshape(rows, v_heads * v_dim)
    if out is None:
        return result
    out.copy_(result)
    return out
