"""The depthwise causal conv1d with carried state (the Gated DeltaNet's short conv) in plain torch: the
twin of kernels/causal_conv1d.py's prefill kernel (which dispatches here off CUDA), and what decode
steps run where the fused decode kernel (kernels/gated_deltanet_decode.py) does not.

A request's conv state holds its last `kernel - 1` inputs, oldest first ([channels, kernel - 1]);
a fresh request starts from zeros, which is exactly the zero left-padding of a plain causal conv.
So a prompt prefilled in chunks gives the same outputs as one pass over the whole prompt."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_with_state(
    x: torch.Tensor,  # [T, channels], one request's new inputs
    state: torch.Tensor,  # [channels, kernel - 1], the request's previous inputs
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(conv(x)) for the new inputs [T, channels], and the new state [channels, kernel - 1]."""
    channels, kernel = weight.shape
    window = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)  # [channels, kernel-1+T]
    out = F.conv1d(window[None], weight[:, None, :], bias, groups=channels)[0]  # [channels, T]
    new_state = window[:, window.shape[1] - (kernel - 1) :]
    return F.silu(out).t().to(x.dtype), new_state


def causal_conv1d_decode(
    x: torch.Tensor,  # [R, channels], one new input per request
    conv_states: torch.Tensor,  # [slots, channels, kernel - 1], updated in place
    state_slots: torch.Tensor,  # int64 [R] (device)
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one-token-per-request case batched over requests, with no host round trip (decode steps)."""
    window = torch.cat([conv_states[state_slots].to(weight.dtype), x.to(weight.dtype)[:, :, None]], dim=2)
    out = (window * weight[None]).sum(-1)
    if bias is not None:
        out = out + bias
    conv_states[state_slots] = window[:, :, 1:].to(conv_states.dtype)
    return F.silu(out).to(x.dtype)


def causal_conv1d_varlen_reference(
    x: torch.Tensor,  # [T, channels], all requests' new inputs, request after request
    conv_states: torch.Tensor,  # [slots, channels, kernel - 1], updated in place
    state_slots: list[int],
    query_lens: list[int],
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty_like(x)
    start = 0
    for slot, qlen in zip(state_slots, query_lens):
        out[start : start + qlen], new_state = causal_conv1d_with_state(
            x[start : start + qlen], conv_states[slot], weight, bias
        )
        conv_states[slot] = new_state.to(conv_states.dtype)
        start += qlen
    return out


def conv_state_after(
    state: torch.Tensor,  # [channels, kernel - 1], the request's inputs before its chunk
    x: torch.Tensor,  # [n, channels], the chunk's first n inputs
    kernel: int,
) -> torch.Tensor:
    """The conv state after a chunk's first n inputs (its last kernel - 1 inputs, oldest first): what a
    snapshot kept inside the chunk holds (the state `causal_conv1d_with_state` would leave had the
    chunk ended there)."""
    window = torch.cat([state, x.t().to(state.dtype)], dim=1)
    return window[:, window.shape[1] - (kernel - 1) :]
