"""Triton paged attention: the decode kernel and the prefill kernel that kernels/paged_attention.py
dispatches to. Twin of both: `paged_attention_reference`.

Arguments, shared by both entry points (and by the dispatch):
  q [T, heads, head_dim]; k_cache, v_cache [pages, page_size, kv_heads, head_dim] (head_dim
  contiguous); page_table int32 [R, max_pages]; query_start int32 [R + 1]; positions int64 [T];
  scale; `out` [T, heads, head_dim] is written (allocated when not given).

Decode (`paged_attention_decode_triton`): one program per (new token, kv head, split of its keys):
the kv head's query heads together (padded to 16 rows for tensor-core dots) over the split's keys
read page by page, an online softmax; a second kernel folds the splits. Every key is read once per kv
head, not once per query head. It serves any batch (every new token has its own programs) but is made
for one new token per request. Under TRITON_INTERPRET=1 the dots run in float32; accumulation is
float32 everywhere.

Prefill (`paged_attention_prefill_triton`): one program per (block of a request's new tokens, kv
head), its rows the block's tokens times the kv head's query heads (GQA: each key block is read once
for all the query heads that share it, and the tile is 64 rows tall for the tensor cores:
`prefill_tiles`), dots over key blocks of 16-32, an online softmax in exp2. Every query row attends to
keys 0..its own position (context + the chunk's earlier tokens and itself); the key blocks before the
block's first position are visible to every row and skip the causal mask, the rest are masked per row.
Rows of a block past the request's last token compute but are not stored. The first key block always
holds key 0, visible to every row, so the running maximum is finite from the first block on and masked
blocks contribute exactly zero. Under TRITON_INTERPRET=1 the dots run in float32 (the interpreter's
bf16 dot is wrong); compiled, they take the cache dtype with float32 accumulation.

A sliding-window layer (WINDOW > 0, gpt-oss) reads only the keys after position - WINDOW: decode splits
those, the prefill starts at the block's first visible key and masks each row's window (a row may then
see no key of a block: its maximum stays -inf, which `_softmax_block` takes as 0). Sinks (HAS_SINKS, a
logit per head, gpt-oss) join each softmax's denominator at the end: decode's combine and the prefill's
store add exp(sink - max) to the sum and rescale by the new maximum.

Both read keys through the same helper (`_paged_kv_block`): masked lanes read the sentinel page 0,
never another request's page (docs/ARCHITECTURE.md, "The memory planner"). A sliding group kept in rings
(RING_PAGES > 0, plan/kv_groups.py) is read through each request's slot instead of a page table: position n
is in page slot x RING_PAGES + (n // PAGE_SIZE) mod RING_PAGES, and the window's mask leaves out the keys a
ring has already overwritten. An fp8 pool (KV_FP8, with
k_scale / v_scale [pages, page_size, kv_heads] float32) is dequantized in registers without a [keys, head_dim]
product: a key row's scale is a factor of its score column, and a value row's of its probability column, so
the e4m3 values go to the dots as q's dtype (exactly: every e4m3 value is a bf16 and an fp16 value) and the
scores and probabilities take the scales (q . k x scale = q . (k x scale)). That keeps the registers of
the model dtype's kernel (tests/unit/kernels/test_fused_kernels_compile.py)."""

from __future__ import annotations

import os
from collections.abc import Container

import torch
import triton
import triton.language as tl

# Decode splits each token's keys into this many shares, computed by as many programs per kv head and
# folded by a second kernel: one token of a model with 2 kv heads is otherwise 2 programs on 132 SMs,
# each reading every key in turn (flash-decoding's split-K). A fixed count keeps the grid the same for
# every step, as a CUDA graph needs; short contexts leave the last splits empty.
DECODE_SPLITS = 16
LOG2E = 1.4426950408889634  # the prefill's softmax runs in exp2: scores are scaled by scale x log2(e)
# On an fp8 pool the probabilities take the value rows' scales (amax / 448) before they round to the dot's
# dtype: lifted by 2^8 there, so that in fp16 they stay normal numbers for rows of small values (and cannot
# overflow: a probability is at most 1, a scale at most 65504 / 448, 2^8 times that 37,430), and brought
# down by the same power of two, exactly, at the output.
V_SCALE_LIFT = tl.constexpr(256.0)


@triton.jit
def _paged_kv_block(
    k_ptr,
    v_ptr,
    page_table_ptr,
    req,
    stride_pt,
    n,
    n_mask,
    d,
    d_mask,
    kv_head,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    ks_ptr,
    vs_ptr,
    stride_sp,
    stride_ss,
    stride_sh,
    PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
    RING_PAGES: tl.constexpr,
):
    """K and V ([BLOCK_N, BLOCK_D], the cache dtype) of key positions `n` of request `req`, and their rows'
    scales ([BLOCK_N] float32; 0 for masked keys) with KV_FP8, else 1. RING_PAGES > 0: the caches are a sliding
    group's rings and `page_table_ptr` the requests' slots [R]: position n is in page
    slot x RING_PAGES + (n // PAGE_SIZE) mod RING_PAGES (plan/kv_groups.py's ring_page)."""
    if RING_PAGES > 0:
        slot = tl.load(page_table_ptr + req).to(tl.int64)
        page = slot * RING_PAGES + ((n // PAGE_SIZE) % RING_PAGES).to(tl.int64)
    else:
        page = tl.load(page_table_ptr + req * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    within = (n % PAGE_SIZE).to(tl.int64)
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(
        k_ptr + page[:, None] * stride_kp + within[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        v_ptr + page[:, None] * stride_vp + within[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if KV_FP8:
        row = page * stride_sp + within * stride_ss + kv_head * stride_sh
        k_scale = tl.load(ks_ptr + row, mask=n_mask, other=0.0)
        v_scale = tl.load(vs_ptr + row, mask=n_mask, other=0.0)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k, v, k_scale, v_scale


# stride_pt is the step's page-table width (its longest request's pages): it changes as requests grow,
# and specialising on it would compile new variants mid-serving
@triton.jit(do_not_specialize=["stride_pt"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    part_ptr,
    page_table_ptr,
    token_req_ptr,
    positions_ptr,
    ks_ptr,
    vs_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_sp,
    stride_ss,
    stride_sh,
    scale,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    WINDOW: tl.constexpr,
    RING_PAGES: tl.constexpr,
):
    """One (token, kv head, split): the GROUP query heads of the kv head over the split's share of the
    token's keys, an online softmax with tensor-core dots; writes (max, sum, unnormalised output)."""
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    num_keys = tl.load(positions_ptr + t).to(tl.int64) + 1  # causal: keys 0..own position
    lowest = 0
    if WINDOW > 0:  # a sliding-window layer: the last WINDOW keys only
        lowest = tl.maximum(num_keys - WINDOW, 0)
    # each split takes a whole number of key blocks, so no block straddles two splits
    per_split = tl.cdiv(tl.cdiv(num_keys - lowest, SPLITS), BLOCK_N) * BLOCK_N
    first = lowest + split * per_split
    last = tl.minimum(first + per_split, num_keys)

    g = tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)

    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(first, last, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < last
        k, v, k_scale, v_scale = _paged_kv_block(
            k_ptr,
            v_ptr,
            page_table_ptr,
            req,
            stride_pt,
            n,
            n_mask,
            d,
            d_mask,
            kv_head,
            stride_kp,
            stride_ks,
            stride_kh,
            stride_vp,
            stride_vs,
            stride_vh,
            ks_ptr,
            vs_ptr,
            stride_sp,
            stride_ss,
            stride_sh,
            PAGE_SIZE,
            KV_FP8,
            RING_PAGES,
        )
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE_DOT:  # float32 models: exact float32 products, not tf32's
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        if KV_FP8:
            s = s * k_scale[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if KV_FP8:
            p = p * (v_scale * V_SCALE_LIFT)[None, :]
        if IEEE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if KV_FP8:
        acc = acc * (1.0 / V_SCALE_LIFT)
    # partials [T, heads, SPLITS, 2 + BLOCK_D]: max, sum, then the output row (an empty split: -inf, 0, 0)
    row = part_ptr + ((t * (tl.num_programs(1) * GROUP) + heads) * SPLITS + split).to(tl.int64) * (2 + BLOCK_D)
    tl.store(row, m_i, mask=g_mask)
    tl.store(row + 1, l_i, mask=g_mask)
    tl.store(row[:, None] + 2 + d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_combine_kernel(
    part_ptr,
    out_ptr,
    sinks_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One (token, head): the splits' partial softmaxes folded into the output row, with the head's sink
    logit in the denominator where HAS_SINKS."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    base = part_ptr + ((t * tl.num_programs(1) + h) * SPLITS + sp).to(tl.int64) * (2 + BLOCK_D)
    m = tl.load(base)
    big_m = tl.max(m, axis=0)  # finite: the first visible key is visible to every token, and split 0 holds it
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        big_m = tl.maximum(big_m, sink)
    w = tl.exp(m - big_m)  # an empty split's -inf gives 0
    l_sum = tl.sum(tl.load(base + 1) * w, axis=0)
    if HAS_SINKS:
        l_sum += tl.exp(sink - big_m)
    acc = tl.sum(tl.load(base[:, None] + 2 + d[None, :]) * w[:, None], axis=0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, (acc / l_sum).to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _softmax_block(s, v, m_i, l_i, acc, v_scale, KV_FP8: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """One key block of the online softmax: scores s [rows, keys] (log2 units), their values v (with KV_FP8,
    e4m3 rows whose scales v_scale [keys] weigh the probabilities). MAY_BE_EMPTY: a row may have seen no key
    yet (a sliding window's); its maximum stays -inf and is taken as 0 in the exponents, so its terms are 0."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MAY_BE_EMPTY:
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_FP8:
        p = p * (v_scale * V_SCALE_LIFT)[None, :]
    return m_new, l_i, acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit(do_not_specialize=["stride_pt"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    page_table_ptr,
    positions_ptr,
    query_start_ptr,
    block_req_ptr,
    block_first_ptr,
    sinks_ptr,
    ks_ptr,
    vs_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_sp,
    stride_ss,
    stride_sh,
    scale_log2,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FP32_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    WINDOW: tl.constexpr,
    RING_PAGES: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    blk = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(block_req_ptr + blk).to(tl.int64)
    first = tl.load(block_first_ptr + blk).to(tl.int64)
    end = tl.load(query_start_ptr + req + 1).to(tl.int64)

    # the block's rows: BLOCK_T tokens x the GROUP query heads of this kv head, token-major
    r = tl.arange(0, BLOCK_R)
    t = first + r // GROUP
    h = kv_head * GROUP + r % GROUP
    m_mask = (r < BLOCK_T * GROUP) & (t < end)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    pos_m = tl.load(positions_ptr + t, mask=m_mask, other=0)
    q = tl.load(
        q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP32_DOT:
        q = q.to(tl.float32)
    last = tl.minimum(end, first + BLOCK_T) - 1
    num_keys = tl.load(positions_ptr + last).to(tl.int64) + 1
    # keys before the block's first position are visible to every row: those blocks need no causal mask
    unmasked_end = (tl.load(positions_ptr + first).to(tl.int64) + 1) // BLOCK_N * BLOCK_N
    masked_start = unmasked_end
    if WINDOW > 0:  # every key block from the first row's first visible key is masked per row
        unmasked_end = 0
        masked_start = tl.maximum(tl.load(positions_ptr + first).to(tl.int64) + 1 - WINDOW, 0) // BLOCK_N * BLOCK_N

    m_i = tl.zeros([BLOCK_R], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for start in range(0, unmasked_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        k, v, k_scale, v_scale = _paged_kv_block(
            k_ptr,
            v_ptr,
            page_table_ptr,
            req,
            stride_pt,
            n,
            n < unmasked_end,
            d,
            d_mask,
            kv_head,
            stride_kp,
            stride_ks,
            stride_kh,
            stride_vp,
            stride_vs,
            stride_vh,
            ks_ptr,
            vs_ptr,
            stride_sp,
            stride_ss,
            stride_sh,
            PAGE_SIZE,
            KV_FP8,
            RING_PAGES,
        )
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        if KV_FP8:
            s = s * k_scale[None, :]
        m_i, l_i, acc = _softmax_block(s, v, m_i, l_i, acc, v_scale, KV_FP8, False)
    for start in range(masked_start, num_keys, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < num_keys
        k, v, k_scale, v_scale = _paged_kv_block(
            k_ptr,
            v_ptr,
            page_table_ptr,
            req,
            stride_pt,
            n,
            n_mask,
            d,
            d_mask,
            kv_head,
            stride_kp,
            stride_ks,
            stride_kh,
            stride_vp,
            stride_vs,
            stride_vh,
            ks_ptr,
            vs_ptr,
            stride_sp,
            stride_ss,
            stride_sh,
            PAGE_SIZE,
            KV_FP8,
            RING_PAGES,
        )
        if FP32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        if KV_FP8:
            s = s * k_scale[None, :]
        visible = (n[None, :] <= pos_m[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            visible = visible & (n[None, :] > pos_m[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_block(s, v, m_i, l_i, acc, v_scale, KV_FP8, WINDOW > 0)
    if KV_FP8:
        acc = acc * (1.0 / V_SCALE_LIFT)
    if HAS_SINKS:  # the head's sink logit joins the denominator (log2 units, as the scores)
        sink = tl.load(sinks_ptr + h, mask=m_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        rescale = tl.math.exp2(m_i - m_new)
        acc = acc * rescale[:, None]
        l_i = l_i * rescale + tl.math.exp2(sink - m_new)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def _prepare(
    name: str, q, k_cache, v_cache, page_table, out, k_scale, v_scale
) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple, dict]:
    """Checks both entry points make; (out, contiguous page table, the scale pointers, the strides both
    kernels take after their pointers, the shape constants both take). Without scales (a pool of the model
    dtype) the scale pointers are the caches, never read, and their strides 0."""
    heads, head_dim = q.shape[1], q.shape[2]
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"{name} needs head_dim contiguous in q and the caches")
    fp8 = k_scale is not None
    if fp8 and (v_scale is None or k_scale.stride() != v_scale.stride() or k_scale.shape != k_cache.shape[:-1]):
        raise ValueError(f"{name}: k_scale and v_scale must both be given, [pages, page_size, kv_heads] alike")
    out = torch.empty_like(q) if out is None else out
    page_table = page_table.contiguous()
    scale_strides = k_scale.stride() if fp8 else (0, 0, 0)
    strides = (
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        *scale_strides,
    )
    shape = dict(PAGE_SIZE=page_size, GROUP=heads // kv_heads, HEAD_DIM=head_dim, KV_FP8=fp8)
    scales = (k_scale, v_scale) if fp8 else (k_cache, v_cache)
    return out, page_table, scales, strides, shape


def token_requests(query_start: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request index of every new token, computed on the device without a host sync."""
    tokens = torch.arange(num_tokens, device=query_start.device, dtype=query_start.dtype)
    return torch.searchsorted(query_start[1:].contiguous(), tokens, right=True)


def paged_attention_decode_triton(
    q,
    k_cache,
    v_cache,
    page_table,
    query_start,
    positions,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int = 32,
    token_request: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
    ring_pages: int = 0,
) -> torch.Tensor:
    """`token_request` (int [T], each token's request): ForwardBatch carries it, made on the host
    with the rest of the step, two launches per layer fewer than deriving it here. `k_scale`/`v_scale`:
    an fp8 pool's scales; `sinks` [heads] a sink logit per head, `window` > 0 a sliding window's keys;
    `ring_pages` > 0: the caches are rings of that many pages and `page_table` the requests' slots [R]."""
    out, page_table, scales, strides, shape = _prepare(
        "paged_attention_decode_triton", q, k_cache, v_cache, page_table, out, k_scale, v_scale
    )
    num_tokens, heads, head_dim = q.shape
    if num_tokens == 0:
        return out
    token_req = token_requests(query_start, num_tokens) if token_request is None else token_request
    kv_heads = k_cache.shape[2]
    block_d = max(16, triton.next_power_of_2(head_dim))
    parts = torch.empty(num_tokens, heads, DECODE_SPLITS, 2 + block_d, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_tokens, kv_heads, DECODE_SPLITS)](
        q,
        k_cache,
        v_cache,
        parts,
        page_table,
        token_req,
        positions,
        *scales,
        *strides,
        scale,
        **shape,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        BLOCK_G=max(16, triton.next_power_of_2(shape["GROUP"])),
        SPLITS=DECODE_SPLITS,
        FP32_DOT=os.environ.get("TRITON_INTERPRET") == "1" or q.dtype == torch.float32,
        IEEE_DOT=q.dtype == torch.float32 and os.environ.get("TRITON_INTERPRET") != "1",
        WINDOW=window,
        RING_PAGES=ring_pages,
    )
    _decode_combine_kernel[(num_tokens, heads)](
        parts,
        out,
        sinks if sinks is not None else parts,  # never read without sinks
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        SPLITS=DECODE_SPLITS,
        HAS_SINKS=sinks is not None,
    )
    return out


def query_blocks(query_lens: list[int], block_m: int, skip: Container[int] = ()) -> tuple[list[int], list[int]]:
    """(request, first token row) of every block of `block_m` new tokens; empty requests and those in
    `skip` (another kernel computes their rows) have none."""
    reqs, firsts, start = [], [], 0
    for r, qlen in enumerate(query_lens):
        for offset in range(0, qlen if r not in skip else 0, block_m):
            reqs.append(r)
            firsts.append(start + offset)
        start += qlen
    return reqs, firsts


def prefill_tiles(head_dim: int, group: int) -> tuple[int, int, int]:
    """(rows a program computes, key block, warps) for a head size: the rows are tokens x the GROUP query
    heads of one kv head, so a key block is read once for all of them. Chosen by bench/prefill_attention.py's
    timings: at head_dim 256, 64 rows x 16 keys on 4 warps (one
    warpgroup) ran 193-198 TFLOPS against 82-89 on 8 warps, though 4 warps spill 40 bytes a thread
    (cuobjdump -res-usage; 8 warps hold in 213 registers); at 128, 64 x 32 on 8 warps holds in 186
    registers. tests/unit/kernels/test_fused_kernels_compile.py holds each to its measured spill."""
    rows, keys, warps = (64, 32, 8) if head_dim <= 128 else (64, 16, 4)
    return max(rows, triton.next_power_of_2(group)), keys, warps


def paged_attention_prefill_triton(
    q,
    k_cache,
    v_cache,
    page_table,
    query_start,
    positions,
    query_lens: list[int],
    scale: float,
    out: torch.Tensor | None = None,
    block_rows: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    skip: Container[int] = (),
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
    ring_pages: int = 0,
) -> torch.Tensor:
    """`block_rows`, `block_n`, `num_warps` override prefill_tiles (tests and the bench); the rows of the
    requests in `skip` are left as they are in `out` (kernels/paged_attention_flash.py computes them).
    `k_scale`/`v_scale`: an fp8 pool's scales; `sinks` [heads] a sink logit per head, `window` > 0 a
    sliding window's keys; `ring_pages` > 0: the caches are rings of that many pages and `page_table` the
    requests' slots [R]."""
    out, page_table, scales, strides, shape = _prepare(
        "paged_attention_prefill_triton", q, k_cache, v_cache, page_table, out, k_scale, v_scale
    )
    rows, keys, warps = prefill_tiles(q.shape[2], shape["GROUP"])
    rows, block_n, num_warps = block_rows or rows, block_n or keys, num_warps or warps
    if rows < shape["GROUP"] or rows & (rows - 1):
        raise ValueError(
            f"block_rows ({rows}) must be a power of two of at least the query heads a kv head has ({shape['GROUP']})"
        )
    block_t = rows // shape["GROUP"]
    reqs, firsts = query_blocks(query_lens, block_t, skip)
    if not reqs:
        return out
    block_req = torch.tensor(reqs, dtype=torch.int32).to(q.device, non_blocking=True)
    block_first = torch.tensor(firsts, dtype=torch.int32).to(q.device, non_blocking=True)
    _prefill_kernel[(len(reqs), k_cache.shape[2])](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        positions,
        query_start,
        block_req,
        block_first,
        sinks if sinks is not None else block_req,  # never read without sinks
        *scales,
        *strides,
        scale * LOG2E,
        **shape,
        BLOCK_D=max(16, triton.next_power_of_2(q.shape[2])),
        BLOCK_N=block_n,
        BLOCK_T=block_t,
        BLOCK_R=rows,
        FP32_DOT=os.environ.get("TRITON_INTERPRET") == "1" or q.dtype == torch.float32,
        WINDOW=window,
        RING_PAGES=ring_pages,
        HAS_SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=2,
    )
    return out
