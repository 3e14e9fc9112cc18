"""The fused Gated DeltaNet decode kernels (kernels/gated_deltanet_decode.py) against their twin,
the model's torch composition (gated_deltanet_decode_reference.py), under the Triton interpreter in
a child process (interpreted_triton.py): requests on non-contiguous slots with a padding row, both
head ratios, head dims that are not powers of two, three decode steps feeding the pools forward;
and the model's GatedDeltaNet taking that path for a bf16 decode step. Slots outside the batch
hold NaN (so a stray read or write shows), outputs start as NaN (so an unwritten element shows).

The interpreter truncates float32 -> bfloat16 where the GPU and torch round to nearest even; the
child rounds to nearest (`_round_bf16_to_nearest`) so that bf16 steps can be held to the float32
tolerance on the states. The conv weights of the bf16/fp16 cases are signed powers of two: the twin
rounds each conv product to the model dtype (causal_conv1d_decode), the kernel accumulates in
float32 (as F.conv1d and the CUDA conv kernels do); with such weights every product is exact and
both give the same activations, which is what lets the states agree to ~1e-5 after three steps."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ferry.kernels.gated_deltanet_decode_reference import gated_deltanet_decode_reference
from tests.unit.interpreted_triton import run_interpreted

STEPS, KERNEL, SLOTS = 3, 4, 8

# (dtype, k_heads, v_heads, k_dim, v_dim, the rows' slots: 0 is the padding slot)
CASES = [
    (torch.float32, 2, 4, 16, 32, [5, 2, 0, 7]),  # grouped heads (v_heads = 2 k_heads), a padding row
    (torch.float32, 3, 3, 32, 16, [1, 6]),  # a value head per key head
    (torch.float32, 2, 2, 24, 20, [3, 0, 4]),  # head dims not powers of two: masked tails
    (torch.bfloat16, 2, 4, 16, 32, [5, 2, 0, 7]),
    (torch.bfloat16, 4, 4, 32, 32, [7, 1, 4]),
    (torch.float16, 1, 2, 16, 16, [2, 0]),
]
# the model dtype's output rounding, one ulp relative
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _conv_weight(channels, g, dtype):
    if dtype == torch.float32:
        return torch.randn(channels, KERNEL, generator=g) * 0.5
    powers = 2.0 ** torch.randint(-3, 1, (channels, KERNEL), generator=g)
    return (powers * torch.where(torch.rand(channels, KERNEL, generator=g) < 0.5, -1.0, 1.0)).to(dtype)


def _case(seed, dtype, k_heads, v_heads, k_dim, v_dim, slots):
    g = torch.Generator().manual_seed(seed)
    rows, conv_size, value_size = len(slots), 2 * k_heads * k_dim + v_heads * v_dim, v_heads * v_dim
    projected = torch.randn(STEPS, rows, conv_size + value_size + 2 * v_heads, generator=g).to(dtype)
    A_log, dt_bias = torch.rand(v_heads, generator=g) * 2.5, torch.randn(v_heads, generator=g)
    A_log[0], dt_bias[0] = -4.0, dt_bias[0] + 21.0  # a + dt_bias on both sides of softplus's threshold (20)
    dt_bias[-1] -= 30.0  # softplus ~ exp(x): 1 + exp(x) rounds to 1
    params = dict(
        conv_weight=_conv_weight(conv_size, g, dtype),
        A_log=A_log,
        dt_bias=dt_bias,
        norm_weight=(torch.randn(v_dim, generator=g) * 0.3 + 1.0).to(dtype),
    )
    conv_states = torch.full((SLOTS, conv_size, KERNEL - 1), float("nan"), dtype=dtype)
    states = torch.full((SLOTS, v_heads, k_dim, v_dim), float("nan"))
    used = torch.tensor(slots)
    conv_states[used] = torch.randn(len(slots), conv_size, KERNEL - 1, generator=g).to(dtype)
    states[used] = torch.randn(len(slots), v_heads, k_dim, v_dim, generator=g) * 0.3
    return projected, params, conv_states, states, used, k_heads


def _steps(decode, projected, params, conv_states, states, slots, k_heads):
    """`decode` over the steps of `projected`: [(output, conv states, states) after each step]."""
    v_heads, _, v_dim = states.shape[1:]
    conv_size = params["conv_weight"].shape[0]
    after = []
    for step in projected:
        qkv, z, b, a = step.split([conv_size, v_heads * v_dim, v_heads, v_heads], dim=-1)
        out = torch.full((step.shape[0], v_heads * v_dim), float("nan"), dtype=step.dtype, device=step.device)
        decode(
            qkv,
            z,
            b,
            a,
            params["conv_weight"],
            params["A_log"],
            params["dt_bias"],
            params["norm_weight"],
            1e-6,
            conv_states,
            states,
            slots,
            k_heads,
            out=out,
        )
        after.append((out, conv_states.clone(), states.clone()))
    return after


def _round_bf16_to_nearest():
    """Child side: float32 -> bfloat16 in the interpreter rounded to nearest even, as on the GPU."""
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(data).view(np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        return truncating(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = convert


# the model layer of the integration case: a tiny qwen3_5_moe-shaped Gated DeltaNet
LAYER = dict(
    hidden_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=KERNEL,
    rms_norm_eps=1e-6,
)


def _layer(weights=None):
    from ferry.services.worker.layers.gated_deltanet import GatedDeltaNet

    s = SimpleNamespace(**LAYER)
    s.linear_key_dim = s.linear_num_key_heads * s.linear_key_head_dim
    s.linear_value_dim = s.linear_num_value_heads * s.linear_value_head_dim
    s.linear_conv_dim = 2 * s.linear_key_dim + s.linear_value_dim
    layer = GatedDeltaNet(s, 0, torch.bfloat16)
    if weights is not None:
        layer.load_state_dict(weights)
    return layer


def _layer_step(weights, x, slots, fresh, conv_states, states):
    """One decode step of the layer: (its output, conv states, states)."""
    batch = SimpleNamespace(
        num_requests=x.shape[0],
        state_slots=slots,
        state_slots_host=slots.tolist(),
        query_lens_host=[1] * x.shape[0],
        query_start=torch.arange(x.shape[0] + 1, dtype=torch.int32),
    )
    pools = SimpleNamespace(linear_state=SimpleNamespace(layer=lambda _: (conv_states, states)))
    with torch.no_grad():
        out = _layer(weights)(x, SimpleNamespace(batch=batch, pools=pools, fresh_state_slots=fresh, cos=None, sin=None))
    return out, conv_states, states


def child(kind, *args):
    """Child side (imported by name under TRITON_INTERPRET=1 and FERRY_TRITON_ON_CPU=1)."""
    _round_bf16_to_nearest()
    if kind == "steps":
        from ferry.kernels.gated_deltanet_decode import gated_deltanet_decode

        return _steps(gated_deltanet_decode, *args)
    from ferry.services.worker.layers import gated_deltanet

    fused, calls = gated_deltanet.gated_deltanet_decode, []
    gated_deltanet.gated_deltanet_decode = lambda *a, **k: calls.append(1) or fused(*a, **k)
    return _layer_step(*args), len(calls)


def _layer_case():
    g = torch.Generator().manual_seed(50)
    layer = _layer()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "proj" in name else 1.0))
        layer.conv1d.weight.copy_(_conv_weight(layer.conv_size, g, torch.bfloat16)[:, None, :])
        layer.A_log.uniform_(0.0, 2.5, generator=g)
    slots = torch.tensor([6, 0, 2, 5])
    x = torch.randn(len(slots), LAYER["hidden_size"], generator=g).bfloat16()
    conv_states = torch.full((SLOTS, layer.conv_size, KERNEL - 1), float("nan"), dtype=torch.bfloat16)
    states = torch.full((SLOTS, layer.v_heads, layer.k_dim, layer.v_dim), float("nan"))
    conv_states[slots] = torch.randn(len(slots), layer.conv_size, KERNEL - 1, generator=g).bfloat16()
    states[slots] = torch.randn(len(slots), layer.v_heads, layer.k_dim, layer.v_dim, generator=g) * 0.3
    fresh = torch.tensor([5])  # a request starting now: its NaN-free but stale state is zeroed first
    return layer.state_dict(), x, slots, fresh, conv_states, states


@pytest.fixture(scope="module")
def runs():
    cases = [_case(i, *c) for i, c in enumerate(CASES)]
    layer_case = _layer_case()
    calls = [(("steps", *c), {}) for c in cases] + [(("layer", *layer_case), {})]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FERRY_TRITON_ON_CPU", "1")
        # by its package path: the child, shared by the tests that set the same FERRY_* variables, has the root on
        # its path, not this folder
        got = run_interpreted("tests.unit.test_kernel_gated_deltanet_decode", "child", calls)
    want = [_steps(gated_deltanet_decode_reference, *c) for c in cases]
    want.append(_layer_step(*layer_case))  # this process takes the torch path (no interpreter here)
    return got, want


@pytest.mark.parametrize("index", range(len(CASES)))
def test_fused_decode_matches_the_torch_composition_over_steps(runs, index):
    dtype = CASES[index][0]
    got, want = runs[0][index], runs[1][index]
    for step, ((out, conv, states), (want_out, want_conv, want_states)) in enumerate(zip(got, want)):
        assert torch.equal(conv.isnan(), want_conv.isnan()), f"step {step}: conv states outside the batch touched"
        assert torch.equal(conv.nan_to_num(), want_conv.nan_to_num()), f"step {step}: conv states differ"
        torch.testing.assert_close(
            states, want_states, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"step {step} states: {m}"
        )
        tol = OUT_TOL[dtype]
        torch.testing.assert_close(
            out.float(), want_out.float(), rtol=tol, atol=tol, msg=lambda m: f"step {step} outputs: {m}"
        )
        if dtype != torch.float32:  # same roundings in the same places: nearly every element bit for bit
            assert (out != want_out).float().mean() <= 0.01, f"step {step}: outputs rounded differently"


def test_the_layer_takes_the_fused_path_for_a_decode_step(runs):
    ((out, conv, states), fused_calls), (want_out, want_conv, want_states) = runs[0][-1], runs[1][-1]
    assert fused_calls == 1
    assert torch.equal(conv.nan_to_num(), want_conv.nan_to_num()) and torch.equal(conv.isnan(), want_conv.isnan())
    torch.testing.assert_close(states, want_states, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert (states[5] != 0).any()  # zeroed, then updated by this step
    # out_proj sums 64 bf16 inputs that may differ by one rounding each
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)


def test_a_step_without_requests_launches_nothing():
    from ferry.kernels.gated_deltanet_decode import gated_deltanet_decode

    projected, params, conv_states, states, _, k_heads = _case(9, *CASES[0])
    empty = projected[0, :0]
    assert _steps(
        gated_deltanet_decode, empty[None], params, conv_states, states, torch.zeros(0, dtype=torch.long), k_heads
    )[0][0].shape == (0, states.shape[1] * states.shape[3])
