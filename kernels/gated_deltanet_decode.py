"""A Gated DeltaNet layer's decode step between in_proj and out_proj in two Triton launches.

Twin: `gated_deltanet_decode_reference` (gated_deltanet_decode_reference.py), the torch
composition the model runs otherwise (causal_conv1d_decode, the gates, the recurrent rule per
request, GatedRMSNorm). In torch + fla that composition is ~35 kernels per layer at decode (cat,
gather, mul, sum, scatter, SiLU; sigmoid; exp/softplus/mul; two repeat_interleave; the state
gather, fla's kernel and the state scatter; the norm), each moving a few KiB except the state:
the launches, not the bytes, were the step's cost. Here every request has exactly one new token.

Why two kernels and not one: kernel 2's program for value head h needs q and k of key head
h // group after the conv, and with grouped heads (v_heads = 2 * k_heads on the Qwen3.5/3-Next
checkpoints) several programs share a key head. Whoever convolves those channels also shifts
their conv state in place, and the other readers would race with that write; the end of a launch
is the cheapest grid-wide "everyone has read the old state" there is. The activated q/k/v
(R x 8192 bf16 on the 35B: 16 KiB a request) take one round trip through L2/HBM between the two.

1. `_conv_decode_kernel`, grid (request row, block of BLOCK_C channels). Depthwise conv over
   [conv_state[slot, c, 0:K-1], x[r, c]] with the conv weight, float32 accumulation (as the CUDA
   conv kernels do; the torch twin rounds each product to bf16 first: within one bf16 rounding of
   this), rounded to the activation dtype, SiLU, rounded again (F.silu on the rounded sum). The
   shifted window is written back to the slot's conv state in place. Channels are independent and
   each belongs to one program, so programs never share state; inside a program a barrier sits
   between all loads of the state and the stores (the shifted tile is a second load of the same
   rows, and whichever thread owns an element in one layout need not own it in the other).
   BLOCK_C = 256 with 2 warps: 4 channels a thread and 32 programs per request on the 35B (8192
   channels x ~24 bytes: x, three state taps read and written, four weights shared by every
   request, the output; ~200 KiB a request, which one SM would read latency bound, so it is
   spread over a few dozen).

2. `_rule_norm_kernel`, grid (request row, value head). The gates for that head (beta =
   sigmoid(b) rounded to the activation dtype, as torch's bf16 sigmoid is; g = -exp(A_log) *
   softplus(a + dt_bias) in float32) are four scalar loads, so they are computed where they are
   used rather than in kernel 1 (no buffer, no write/read between the launches). q and k come from
   the key head h // group of the activated row (no repeat_interleave), are L2-normalised as fla's
   `use_qk_l2norm_in_kernel` does (x / sqrt(sum x^2 + 1e-6)) and q is scaled by k_dim^-1/2. The
   head's float32 state S [k_dim, v_dim] is read in place from states[state_slots[r], h], decayed,
   updated by the delta rule and written back; o = S_new^T q is taken from the same pass over the
   tile as o = (q^T S_dec) + (q.k) delta, so both reductions over k read the decayed tile once.
   o is rounded to the activation dtype (what the twin hands the norm), then GatedRMSNorm with the
   rounding of kernels/rms_norm.py, written to out [R, v_heads * v_dim] ready for out_proj.
   The norm needs the whole row of v_dim outputs, so one program owns a head's whole 128 x 128
   tile (64 KiB float32, loaded at once in 16-byte vectors: 64 KiB in flight per program, about
   what an SM's share of HBM bandwidth needs in flight at HBM latency). 8 warps: 64 state values a thread, 128 registers
   for sm_90 by ptxas, no spills, so two programs fit an SM; 4 warps need 208 registers (one
   program an SM), 16 warps gain nothing but cross-warp reduction traffic. Splitting v over
   programs would give more programs at one request (32 on the 35B) but would need a
   cross-program reduction for the norm (a third launch, or counters to reset); from 4 requests
   up the grid already has more programs than a Hopper card has SMs (132), and at one request the 2 MiB of
   state per layer is a few microseconds of latency-bound reading against ~45 us of launches.

Neither kernel takes the request count (it is only the grid), so one compiled variant serves
every decode batch and graph bucket (docs/ARCHITECTURE.md, "No compile while serving"); the other
integers are the model's strides and sizes. Nothing reads device data on the host and nothing is
allocated by value, so the launches are CUDA-graph safe. Rows read their slot from `state_slots`
on the device; padding rows read and write only the padding slot (several padding rows race on
it, harmlessly: its contents only ever feed padding rows, whose outputs nobody reads)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONV_BLOCK = 256
CONV_WARPS = 2


@triton.jit
def _conv_decode_kernel(
    x_ptr,
    conv_ptr,
    slot_ptr,
    w_ptr,
    out_ptr,
    C,
    stride_x,
    stride_cs,
    stride_cc,
    stride_wc,
    KERNEL: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < C
    taps = tl.arange(0, BLOCK_K)[None, :]
    slot = tl.load(slot_ptr + r).to(tl.int64)
    x = tl.load(x_ptr + r * stride_x + offs, mask=ok, other=0.0)
    state = conv_ptr + slot * stride_cs + offs[:, None] * stride_cc  # [BLOCK_C, 1], taps at unit stride
    history = tl.load(state + taps, mask=ok[:, None] & (taps < KERNEL - 1), other=0.0)
    window = tl.where(taps == KERNEL - 1, x[:, None].to(tl.float32), history.to(tl.float32))
    w = tl.load(w_ptr + offs[:, None] * stride_wc + taps, mask=ok[:, None] & (taps < KERNEL), other=0.0)
    out_ty = out_ptr.dtype.element_ty
    y = tl.sum(window * w.to(tl.float32), axis=1).to(out_ty).to(tl.float32)
    tl.store(out_ptr + r * C + offs, (y / (1.0 + tl.exp(-y))).to(out_ty), mask=ok)
    # the new state: taps 1..K-1 of the window (the oldest input drops out)
    shifted = tl.load(state + taps + 1, mask=ok[:, None] & (taps < KERNEL - 2), other=0.0)
    shifted = tl.where(taps == KERNEL - 2, x[:, None].to(shifted.dtype), shifted)
    tl.debug_barrier()  # every load of this program's conv state is performed before any store to it
    tl.store(state + taps, shifted, mask=ok[:, None] & (taps < KERNEL - 1))


@triton.jit
def _rule_norm_kernel(
    qkv_ptr,
    z_ptr,
    b_ptr,
    a_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    slot_ptr,
    norm_w_ptr,
    out_ptr,
    stride_qkv,
    stride_z,
    stride_b,
    stride_a,
    stride_ss,
    stride_sh,
    key_size,
    v_heads,
    group,
    scale,
    eps,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h // group
    slot = tl.load(slot_ptr + r).to(tl.int64)
    out_ty = out_ptr.dtype.element_ty
    dk = tl.arange(0, BLOCK_K)
    dv = tl.arange(0, BLOCK_V)
    k_ok = dk < K_DIM
    v_ok = dv < V_DIM

    row = qkv_ptr + r * stride_qkv
    q = tl.load(row + kh * K_DIM + dk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(row + key_size + kh * K_DIM + dk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * key_size + h * V_DIM + dv, mask=v_ok, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)

    beta = tl.sigmoid(tl.load(b_ptr + r * stride_b + h).to(tl.float32)).to(out_ty).to(tl.float32)
    x = tl.load(a_ptr + r * stride_a + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    # softplus as torch's (threshold 20); log1p(e) as log(u) * e / (u - 1), exact where u = 1 + e rounds
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    softplus = tl.where(x > 20.0, x, tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0))))
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus)

    tile = state_ptr + slot * stride_ss + h * stride_sh + dk[:, None] * V_DIM + dv[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    s = tl.load(tile, mask=tile_ok, other=0.0) * decay
    predicted = tl.sum(s * k[:, None], axis=0)
    q_s = tl.sum(s * q[:, None], axis=0)
    delta = beta * (v - predicted)
    s = s + k[:, None] * delta[None, :]
    tl.debug_barrier()  # the whole tile is read before any thread overwrites part of it
    tl.store(tile, s, mask=tile_ok)
    o = (q_s + tl.sum(q * k, axis=0) * delta).to(out_ty).to(tl.float32)

    # GatedRMSNorm as kernels/rms_norm.py rounds it: weight * x_hat in the model dtype, times SiLU(z)
    x_hat = o * tl.rsqrt(tl.sum(o * o, axis=0) / V_DIM + eps)
    w = tl.load(norm_w_ptr + dv, mask=v_ok, other=0.0).to(tl.float32)
    y = (w * x_hat.to(out_ty).to(tl.float32)).to(out_ty).to(tl.float32)
    z = tl.load(z_ptr + r * stride_z + h * V_DIM + dv, mask=v_ok, other=0.0).to(tl.float32)
    y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + r * (v_heads * V_DIM) + h * V_DIM + dv, y.to(out_ty), mask=v_ok)


def rule_norm_warps(k_dim: int, v_dim: int) -> int:
    """8 warps for a 128 x 128 float32 tile (64 registers a thread for the state), fewer for small heads."""
    elements = triton.next_power_of_2(k_dim) * triton.next_power_of_2(v_dim)
    return 8 if elements >= 128 * 64 else 4


def gated_deltanet_decode(
    qkv: torch.Tensor,  # [R, 2 * key_size + value_size], in_proj's q|k|v rows (a view: unit stride along dim 1)
    z: torch.Tensor,  # [R, v_heads * v_dim], the output gate (a view)
    beta_logit: torch.Tensor,  # [R, v_heads] (a view)
    a: torch.Tensor,  # [R, v_heads] (a view)
    conv_weight: torch.Tensor,  # [conv_size, kernel]
    A_log: torch.Tensor,  # [v_heads] float32
    dt_bias: torch.Tensor,  # [v_heads] float32
    norm_weight: torch.Tensor,  # [v_dim], GatedRMSNorm's weight
    norm_eps: float,
    conv_states: torch.Tensor,  # [slots, conv_size, kernel - 1], updated in place
    states: torch.Tensor,  # [slots, v_heads, k_dim, v_dim] float32, updated in place
    state_slots: torch.Tensor,  # int64 [R] (device)
    k_heads: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer's core output [R, v_heads * v_dim] in qkv's dtype, one new token per request."""
    rows, conv_size = qkv.shape
    v_heads, k_dim, v_dim = states.shape[1:]
    key_size, kernel = k_heads * k_dim, conv_weight.shape[1]
    if (
        conv_size != 2 * key_size + v_heads * v_dim
        or v_heads % k_heads
        or conv_weight.shape[0] != conv_size
        or conv_states.shape[1:] != (conv_size, kernel - 1)
        or kernel < 2
        or z.shape != (rows, v_heads * v_dim)
        or beta_logit.shape != (rows, v_heads)
        or a.shape != (rows, v_heads)
        or min(t.stride(-1) for t in (qkv, z, beta_logit, a, conv_weight, conv_states)) != 1
        or states.stride()[2:] != (v_dim, 1)
        or state_slots.shape != (rows,)
    ):
        raise ValueError(
            f"gated_deltanet_decode: qkv {tuple(qkv.shape)}, z {tuple(z.shape)}, b {tuple(beta_logit.shape)}, "
            f"a {tuple(a.shape)}, conv weight {tuple(conv_weight.shape)}, conv states {tuple(conv_states.shape)}, "
            f"states {tuple(states.shape)} stride {states.stride()}, {k_heads} key heads"
        )
    if out is None:
        out = torch.empty(rows, v_heads * v_dim, dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (rows, v_heads * v_dim) or not out.is_contiguous() or out.dtype != qkv.dtype:
        raise ValueError(f"gated_deltanet_decode: out must be a contiguous [{rows}, {v_heads * v_dim}] {qkv.dtype}")
    if not rows:
        return out
    activated = torch.empty(rows, conv_size, dtype=qkv.dtype, device=qkv.device)
    _conv_decode_kernel[(rows, triton.cdiv(conv_size, CONV_BLOCK))](
        qkv,
        conv_states,
        state_slots,
        conv_weight,
        activated,
        conv_size,
        qkv.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        conv_weight.stride(0),
        KERNEL=kernel,
        BLOCK_K=triton.next_power_of_2(kernel),
        BLOCK_C=CONV_BLOCK,
        num_warps=CONV_WARPS,
    )
    _rule_norm_kernel[(rows, v_heads)](
        activated,
        z,
        beta_logit,
        a,
        A_log,
        dt_bias,
        states,
        state_slots,
        norm_weight,
        out,
        activated.stride(0),
        z.stride(0),
        beta_logit.stride(0),
        a.stride(0),
        states.stride(0),
        states.stride(1),
        key_size,
        v_heads,
        v_heads // k_heads,
        k_dim**-0.5,
        norm_eps,
        K_DIM=k_dim,
        V_DIM=v_dim,
        BLOCK_K=triton.next_power_of_2(k_dim),
        BLOCK_V=triton.next_power_of_2(v_dim),
        num_warps=rule_norm_warps(k_dim, v_dim),
    )
    return out
