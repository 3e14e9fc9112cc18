"""Child side of the prefill conv cases (test_kernel_causal_conv1d.py): the Triton kernels under the
interpreter, with the states they leave."""

from __future__ import annotations

from ferry.kernels.causal_conv1d import causal_conv1d_varlen_triton


def prefill(x, states, slots, start, longest, weight):
    out = causal_conv1d_varlen_triton(x, states, slots, start, longest, weight)
    return out, states
