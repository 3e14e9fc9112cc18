"""The fused Gated DeltaNet decode kernels compiled on a real GPU at Qwen3.6-35B-A3B's shapes (16 key
heads, 32 value heads, 128-dim heads, conv kernel 4) against their twin, the model's torch
composition, over three decode steps; replayed from a CUDA graph (the decode step is captured);
and launched with no host synchronisation. Skipped without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_kernel_gated_deltanet_decode import _conv_weight, _steps  # noqa: E402

from ferry.kernels.gated_deltanet_decode import gated_deltanet_decode  # noqa: E402
from ferry.kernels.gated_deltanet_decode_reference import gated_deltanet_decode_reference  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

K_HEADS, V_HEADS, K_DIM, V_DIM, KERNEL, POOL_SLOTS, STEPS = 16, 32, 128, 128, 4, 24, 3
SLOTS = [9, 3, 0, 17, 4]  # non-contiguous, one padding row (slot 0)


def _case(device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, conv_size, value_size = len(SLOTS), 2 * K_HEADS * K_DIM + V_HEADS * V_DIM, V_HEADS * V_DIM
    # in_proj's output as the model splits it: [q k v | z | b | a] rows, qkv etc. strided views of it
    projected = torch.randn(STEPS, rows, conv_size + value_size + 2 * V_HEADS, generator=g).to(dtype)
    params = dict(
        conv_weight=_conv_weight(conv_size, g, dtype),  # powers of two in bf16 (see TOLERANCES)
        A_log=torch.rand(V_HEADS, generator=g) * 2.5,
        dt_bias=torch.randn(V_HEADS, generator=g),
        norm_weight=(torch.randn(V_DIM, generator=g) * 0.3 + 1.0).to(dtype),
    )
    conv_states = torch.full((POOL_SLOTS, conv_size, KERNEL - 1), float("nan"), dtype=dtype)
    states = torch.full((POOL_SLOTS, V_HEADS, K_DIM, V_DIM), float("nan"))
    used = torch.tensor(SLOTS)
    conv_states[used] = torch.randn(len(SLOTS), conv_size, KERNEL - 1, generator=g).to(dtype)
    states[used] = torch.randn(len(SLOTS), V_HEADS, K_DIM, V_DIM, generator=g) * 0.3
    move = lambda t: t.to(device)  # noqa: E731
    return move(projected), {k: move(v) for k, v in params.items()}, move(conv_states), move(states), move(used)


def _split(step):
    conv_size = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM
    return step.split([conv_size, V_HEADS * V_DIM, V_HEADS, V_HEADS], dim=-1)


# dtype -> (states rtol, atol; outputs rtol, atol). float32: the same arithmetic up to float32 order and
# the GPU's fast exp / sqrt. bf16: the conv weights are powers of two, so the twin's bf16-rounded conv
# products are exact and nearly every activation is the same bits on both sides; but SiLU and sigmoid(b)
# use the GPU's fast exp here and torch's exact one there, so now and then a value lands on the other
# side of a bf16 rounding: 2^-8 of one v (or k) element, up to ~5e-3 on a column of a head's state.
TOLERANCES = {torch.float32: (1e-4, 1e-5, 1e-4, 1e-4), torch.bfloat16: (1e-2, 1e-2, 2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_fused_decode_matches_the_twin_at_the_35b_shapes(cuda_device, dtype):
    projected, params, conv_states, states, slots = _case(cuda_device, dtype)
    want_conv, want_states = conv_states.clone(), states.clone()
    want = _steps(gated_deltanet_decode_reference, projected, params, want_conv, want_states, slots, K_HEADS)
    got = _steps(gated_deltanet_decode, projected, params, conv_states, states, slots, K_HEADS)
    s_rtol, s_atol, o_rtol, o_atol = TOLERANCES[dtype]
    for step, ((out, conv, st), (w_out, w_conv, w_st)) in enumerate(zip(got, want)):
        assert torch.equal(conv.isnan(), w_conv.isnan()) and torch.equal(conv.nan_to_num(), w_conv.nan_to_num()), step
        torch.testing.assert_close(st, w_st, rtol=s_rtol, atol=s_atol, equal_nan=True)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), w_out.float(), rtol=o_rtol, atol=o_atol)


def test_fused_decode_replays_from_a_cuda_graph_without_host_syncs(cuda_device):
    dtype = torch.bfloat16
    projected, params, conv_states, states, slots = _case(cuda_device, dtype, seed=1)
    eager_conv, eager_states = conv_states.clone(), states.clone()
    eager = _steps(gated_deltanet_decode, projected, params, eager_conv, eager_states, slots, K_HEADS)

    # the captured step reads its inputs from static buffers, as the decode graphs do
    step_in = projected[0].clone()
    out = torch.empty(len(SLOTS), V_HEADS * V_DIM, dtype=dtype, device=cuda_device)

    def args():
        return (
            *_split(step_in),
            params["conv_weight"],
            params["A_log"],
            params["dt_bias"],
            params["norm_weight"],
            1e-6,
            conv_states,
            states,
            slots,
            K_HEADS,
        )

    warm_conv, warm_states = conv_states.clone(), states.clone()
    gated_deltanet_decode(*args(), out=out)  # compiles outside the capture
    conv_states.copy_(warm_conv)
    states.copy_(warm_states)
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation in the launch raises
    try:
        gated_deltanet_decode(*args(), out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    conv_states.copy_(warm_conv)
    states.copy_(warm_states)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gated_deltanet_decode(*args(), out=out)
    conv_states.copy_(warm_conv)  # capture launches nothing, but start every replay from the same pools
    states.copy_(warm_states)
    for step in range(STEPS):
        step_in.copy_(projected[step])
        graph.replay()
        want_out, want_conv, want_states = eager[step]
        assert torch.equal(out, want_out), f"step {step}: the replayed output differs from eager"
        assert torch.equal(conv_states.nan_to_num(), want_conv.nan_to_num()), step
        assert torch.equal(states.nan_to_num(), want_states.nan_to_num()), step
