"""The dense projections of a decode step (a few tokens), in Triton: out[M, N] = x[M, K] @ W[N, K]^T + bias.

Why not cuBLAS everywhere: on some of our layers' shapes it picks tiles that leave HBM idle. In the
12-layer Qwen3-30B cut's profile o_proj's 16.8 MB took 9.0 µs
through a split-K kernel and its reduce (1.9 TB/s of the card's ~4), and the router's 0.5 MB 4.9 µs
on two programs. Elsewhere cuBLAS is as fast, so a measured table (TILES) says which shapes come
here. A decode step reads each weight once, so the kernel is paced by the bytes in flight. Each program computes BLOCK_N
outputs for every token over the whole of K. It reads its weight rows once, BLOCK_K inputs a loop step, and enough
programs run for the whole GPU, without split-K and without a second launch. One token multiplies and sums in
registers. Two to sixteen tokens go through one tensor-core dot a step (the tokens padded to 16).

Rounding follows cuBLAS: products summed in float32, bias added in float32, one rounding to the
output dtype. Only the order of the sum differs (float32 rounding). `dense_linear` is F.linear's
contract. Off the Triton path, or past DENSE_GEMV_MAX_TOKENS tokens (prefill, where cuBLAS's GEMMs
are at their best), it is F.linear itself, the reference twin. `FERRY_DENSE_GEMV=0` in the worker's
environment sends every call to F.linear (the bench's A/B against cuBLAS)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ferry.kernels.dispatch import use_triton

# the dot path's token block, padded: tensor-core dots need 16 rows or more, and one block serves every call
DENSE_GEMV_MAX_TOKENS = 16
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # its bf16 dots are wrong: upcast there
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ENABLED = os.environ.get("FERRY_DENSE_GEMV", "1") != "0"


@dataclass(frozen=True)
class GemvTiles:
    rows: int  # outputs (of N) a program computes
    k: int  # inputs (of K) a loop step reads
    warps: int = 4
    stages: int = 3  # loads in flight a program (Triton's software pipelining)


# (N, K) -> (tiles for one token, tiles for 2-16 tokens); None, or a shape absent, is cuBLAS's. Measured
# by bench/dense_gemv_sweep.py (rerun it on a new card): a shape takes the kernel
# where its best tile beat cuBLAS, inside a CUDA graph with the weights cold in L2.
# Per layer of the 12-layer Qwen3-30B cut at one token: 21.9 µs on cuBLAS, 18.1 here; the hybrid cut's
# 27.4 / 26.2 at one token, 32.8 / 29.4 at eight.
_ROUTER = GemvTiles(rows=4, k=1024, warps=4, stages=1)
_ONE_TOKEN_K4096 = GemvTiles(rows=4, k=1024, warps=4, stages=3)
_WIDE_DOT = GemvTiles(rows=64, k=128, warps=4, stages=4)
TILES: dict[tuple[int, int], tuple[GemvTiles | None, GemvTiles | None]] = {
    (128, 2048): (_ROUTER, None),  # Qwen3-30B's router: 2.5 µs against cuBLAS's 5.1 (two programs)
    (2048, 4096): (_ONE_TOKEN_K4096, None),  # o_proj, Gated DeltaNet out_proj: 7.6 against 8.8
    (5120, 2048): (None, None),  # Qwen3-30B's q/k/v: cuBLAS within 3 %
    (12352, 2048): (None, _WIDE_DOT),  # Qwen3.5/3.6's Gated DeltaNet in_proj: 15.2 against 16.8 at 8 tokens
    (9216, 2048): (None, _WIDE_DOT),  # their gated q/k/v: 12.0 against 12.4 at 8
    (257, 2048): (None, GemvTiles(rows=16, k=256, warps=4, stages=4)),  # router + shared gate: 6.2 against 8.3 at 8
}
# the interpreter (CPU checks of the CUDA path) runs the kernel on every shape, with these
_INTERPRETED_TILES = (GemvTiles(rows=16, k=512), GemvTiles(rows=16, k=256))


def _load_override(path: str | None) -> None:
    """FERRY_DENSE_GEMV_TILES=<a dense_gemv_sweep.json>: that sweep's choices instead of the table (the
    bench serves what it just measured before the table is written)."""
    if not path:
        return
    import json

    chosen = json.loads(Path(path).read_text())["chosen"]
    TILES.clear()
    for shape, (one, dot) in chosen.items():
        n, k = map(int, shape.split("x"))
        TILES[(n, k)] = (one and GemvTiles(**one), dot and GemvTiles(**dot))


_load_override(os.environ.get("FERRY_DENSE_GEMV_TILES"))


def tiles_for(tokens: int, n: int, k: int) -> GemvTiles | None:
    """The tiles of a `tokens` x [N, K] call, or None where cuBLAS is the faster."""
    one, dot = TILES.get((n, k), _INTERPRETED_TILES if _INTERPRETING else (None, None))
    return one if tokens == 1 else dot


def _served_tiles(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> GemvTiles | None:
    """The tiles `dense_linear(x, weight, bias)` runs the Triton kernel with, or None for F.linear."""
    if not (
        _ENABLED
        and use_triton(x)
        and x.dim() == 2
        and 0 < x.shape[0] <= DENSE_GEMV_MAX_TOKENS
        and weight.dim() == 2
        and x.dtype == weight.dtype
        and x.dtype in _DTYPES
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and x.shape[1] == weight.shape[1]
        and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1] and bias.stride(0) == 1))
    ):
        return None
    return tiles_for(x.shape[0], *weight.shape)


def use_dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `dense_linear(x, weight, bias)` runs the Triton kernel (else it is F.linear)."""
    return _served_tiles(x, weight, bias) is not None


@triton.jit
def row_block_dot(a_row, w_ptrs, n_ok, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N]: the weight rows at `w_ptrs` ([BLOCK_N, BLOCK_K] pointers to each row's first
    BLOCK_K inputs, rows contiguous) times the input row `a_row` over all K inputs, BLOCK_K a loop step,
    the products kept apart in registers and summed across K once at the end. One token's GEMV here
    and the routed experts' down projection (expert_pair_gemv.py) both read their rows this way."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(a_row + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += w * a[None, :]
    return tl.sum(acc, axis=1)


# M follows the step's token count: not specialised on, so a step of a new size never compiles a new
# variant mid-serving (one token and the dot path are the two variants a shape has)
@triton.jit(do_not_specialize=["M"])
def _dense_gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    out_ty = out_ptr.dtype.element_ty
    if BLOCK_M == 1:  # one token: products in registers, one sum across K at the end
        y = row_block_dot(x_ptr, w_ptrs, n_ok, K, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, y.to(out_ty), mask=n_ok)
    else:  # a few tokens: W [BLOCK_N, BLOCK_K] times the tokens' inputs [BLOCK_K, BLOCK_M] on tensor cores
        offs_m = tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k + k0 < K
            a = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ty), mask=n_ok[:, None] & m_ok[None, :])


def dense_gemv_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: GemvTiles | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) for 1 <= M <= DENSE_GEMV_MAX_TOKENS, x's dtype out; rows
    of x and of the weight contiguous (a row view of a fused weight is fine). `tiles` overrides the
    table's (the sweep); a shape the table leaves to cuBLAS takes the interpreter's."""
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= DENSE_GEMV_MAX_TOKENS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"dense_gemv_triton takes 1-{DENSE_GEMV_MAX_TOKENS} rows of K contiguous inputs and an "
            f"[N, K] weight with contiguous rows, not x {tuple(x.shape)} weight {tuple(weight.shape)}"
        )
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] tensor, not {tuple(bias.shape)}")
    tiles = tiles or tiles_for(m, n, k) or _INTERPRETED_TILES[m > 1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 1 if m == 1 else DENSE_GEMV_MAX_TOKENS
    _dense_gemv_kernel[(triton.cdiv(n, tiles.rows),)](
        x,
        weight,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=tiles.rows,
        BLOCK_K=tiles.k,
        UPCAST=_INTERPRETING or x.dtype == torch.float32,
        PRECISION="ieee" if x.dtype == torch.float32 else None,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    return out


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): the Triton GEMV for a decode step's few tokens on the Triton path,
    F.linear itself elsewhere (x of any rank there)."""
    tiles = _served_tiles(x, weight, bias)  # looked up once a call: this is every decode projection
    if tiles is not None:
        return dense_gemv_triton(x, weight, bias, tiles)
    return F.linear(x, weight, bias)
