"""Reference twins of the gated delta rule (the Gated DeltaNet's linear attention), in float32.

Per value head, with state S [k_dim, v_dim], decay g_t <= 0 (log space) and rate beta_t in (0, 1):
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T      o_t = S_t^T q_t
q and k are L2-normalised first and q is scaled by k_dim^-1/2 (what the Qwen checkpoints were
trained with; fla's `use_qk_l2norm_in_kernel=True`). Grouped heads: each q/k head serves
v_heads / k_heads consecutive value heads.

`recurrent` runs the definition token by token (decode). `chunked` is the same function computed
a chunk at a time (prefill): inside a chunk the corrections delta_i depend on each other through
a unit lower-triangular system, solved at once; across chunks the state carries over. The two
agree to float32 rounding, which the kernel tests check."""

from __future__ import annotations

import torch


def _prepare(q, k, v, g, beta):
    """float32, L2-normalised and scaled q/k expanded to the value heads; layout [heads, T, dim]."""
    v_heads, k_heads = v.shape[1], k.shape[1]
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if v_heads != k_heads:
        q = q.repeat_interleave(v_heads // k_heads, dim=1)
        k = k.repeat_interleave(v_heads // k_heads, dim=1)
    return (
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.float().transpose(0, 1),
        g.float().transpose(0, 1),
        beta.float().transpose(0, 1),
    )


def gated_delta_rule_recurrent(
    q: torch.Tensor,  # [T, k_heads, k_dim]
    k: torch.Tensor,  # [T, k_heads, k_dim]
    v: torch.Tensor,  # [T, v_heads, v_dim]
    g: torch.Tensor,  # [T, v_heads]
    beta: torch.Tensor,  # [T, v_heads]
    state: torch.Tensor,  # [v_heads, k_dim, v_dim], the request's state before these tokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [T, v_heads, v_dim] (float32) and the final state (float32)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float().clone()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        predicted = torch.einsum("hk,hkv->hv", k[:, t], s)
        delta = beta[:, t, None] * (v[:, t] - predicted)
        s = s + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hk,hkv->hv", q[:, t], s)
    return out.transpose(0, 1), s


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gated_delta_rule_recurrent`, a chunk at a time."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = state.float().clone()
    heads, length = v.shape[:2]
    out = torch.empty_like(v)
    for c0 in range(0, length, chunk_size):
        c1 = min(c0 + chunk_size, length)
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        gamma = g[:, c0:c1].cumsum(-1)  # log of the decay from the chunk start to each token
        n = c1 - c0
        # decay[i, j] = exp(gamma_i - gamma_j) for j <= i: the decay between token j and token i
        lower = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        log_decay = (gamma[:, :, None] - gamma[:, None, :]).masked_fill(~lower, float("-inf"))
        decay = log_decay.exp()
        # delta_i = beta_i (v_i - exp(gamma_i) k_i^T S0 - sum_{j<i} decay_ij (k_i.k_j) delta_j)
        coupling = bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay.tril(-1)
        eye = torch.eye(n, dtype=v.dtype, device=v.device)
        rhs = bc[:, :, None] * (vc - gamma.exp()[:, :, None] * (kc @ s))
        delta = torch.linalg.solve_triangular(eye + coupling, rhs, upper=False, unitriangular=True)
        # o_i = exp(gamma_i) q_i^T S0 + sum_{j<=i} decay_ij (q_i.k_j) delta_j
        out[:, c0:c1] = gamma.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ delta
        # S_end = exp(gamma_end) S0 + sum_j exp(gamma_end - gamma_j) k_j delta_j^T
        to_end = (gamma[:, -1:] - gamma).exp()
        s = gamma[:, -1].exp()[:, None, None] * s + (kc * to_end[:, :, None]).transpose(-1, -2) @ delta
    return out.transpose(0, 1), s
