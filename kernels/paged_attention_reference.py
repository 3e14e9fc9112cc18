"""Reference twin of paged attention: each request's K/V gathered from its pages, then plain
causal attention with grouped-query heads, in float32.

Token t of request r sits at position context_len[r] + i (i = its index among the request's new
tokens) and attends to positions 0..that position: the cached context plus the new tokens up to
itself. The caller has already written the new tokens' K/V into the pages (`write_kv`), so the
pages are the only source of keys and values, exactly as for the Triton kernel. A sliding-window
layer (`window` > 0) sees only positions past that position - window; `sinks` (a logit per head) join
each softmax's denominator and weigh no value (gpt-oss, as transformers' eager attention). A sliding group
kept in rings (`ring_pages` > 0, plan/kv_groups.py) is read through each request's ring: positions older than
the ring alias newer ones' rows, which the window masks.

An fp8 KV pool (--kv-cache-dtype fp8) keeps e4m3 values and one float32 scale per (token, kv head) row,
beside the caches as k_scale / v_scale [pages, page_size, kv_heads]: `quantize_kv_rows` is the rule every
write path follows (kernels/qk_norm_rope.py's too), and reads multiply each row by its scale."""

from __future__ import annotations

import torch

from ferry.kernels.kv_ring import ring_page_table
from ferry.shared.units import ceil_div

# e4m3's largest finite value: a row's amax is stored as this (e4m3fn has no infinity, and torch's cast of a
# value past it gives NaN, so quotients are clamped to it)
KV_FP8_MAX = 448.0
# a row whose amax is below this (all zeros, say) is scaled as if its amax were this: no division by zero,
# and its values, below 1e-8, come back within 1e-8 / 16
KV_AMAX_FLOOR = 1e-8


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (e4m3 values [..., head_dim], float32 scales [...]): scale = max(amax, floor) / 448
    of each row, values = x / scale, rounded to nearest even. Divided, not multiplied by a reciprocal, so the
    Triton writers (tl.math.div_rn) store the same bytes."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(KV_AMAX_FLOOR)
    # by a tensor, not the Python number: CUDA torch multiplies by a scalar divisor's reciprocal (1 ulp off)
    scale = amax / torch.full_like(amax, KV_FP8_MAX)
    values = (xf / scale.unsqueeze(-1)).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def write_kv(
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]: flat row page * page_size + offset
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,  # float32 [pages, page_size, kv_heads]: an fp8 pool's scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store the new tokens' K/V at their rows; views keep the pool's storage, so this writes in place.
    With scales (an fp8 pool) each row is quantized (`quantize_kv_rows`) and its scale stored beside it."""
    kv_heads, head_dim = k_cache.shape[-2:]
    if k_scale is None:
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
        return
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        values, scale = quantize_kv_rows(x)
        # as bytes: torch's CPU index_copy_ has no float8 kernel, and a copy of bytes is the same store
        cache.view(torch.uint8).view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, values.view(torch.uint8))
        scales.view(-1, kv_heads).index_copy_(0, slot_mapping, scale)


def gather_request_kv(
    cache: torch.Tensor,
    pages: torch.Tensor,
    length: int,
    into: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The first `length` positions of one request, [length, kv_heads, head_dim], read through its page list;
    into `into`'s first pages ([pages, page_size, kv_heads, head_dim]) where it has room, else a new tensor.
    With `scales` (an fp8 pool's, [pages, page_size, kv_heads]) the rows come back dequantized, value x scale
    rounded once to `dtype` (float32 by default)."""
    page_size = cache.shape[1]
    needed = ceil_div(length, page_size)
    index = pages[:needed].long()
    if scales is not None:
        rows = (cache[index].float() * scales[index].unsqueeze(-1)).to(dtype or torch.float32)
        if into is not None and needed <= into.shape[0]:
            rows = into[:needed].copy_(rows)
        return rows.reshape(-1, *cache.shape[2:])[:length]
    if into is not None and needed <= into.shape[0]:
        rows = torch.index_select(cache, 0, index, out=into[:needed])
    else:
        rows = cache[index]  # [needed, page_size, kv_heads, head_dim]
    return rows.reshape(-1, *cache.shape[2:])[:length]


def paged_attention_reference(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # int [R, max_pages]
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
    k_scale: torch.Tensor | None = None,  # an fp8 pool's scales, [pages, page_size, kv_heads]
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,  # [heads]
    window: int = 0,
    ring_pages: int = 0,  # > 0: the caches are rings of this many pages, page_table the requests' slots [R]
) -> torch.Tensor:
    heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    start = 0
    if ring_pages:
        longest = max((c + n for c, n in zip(context_lens, query_lens)), default=0)
        page_table = ring_page_table(page_table, ring_pages, ceil_div(longest, k_cache.shape[1]))
    for r, (qlen, ctx) in enumerate(zip(query_lens, context_lens)):
        total = ctx + qlen
        k = gather_request_kv(k_cache, page_table[r], total, scales=k_scale).float().repeat_interleave(group, dim=1)
        v = gather_request_kv(v_cache, page_table[r], total, scales=v_scale).float().repeat_interleave(group, dim=1)
        qr = q[start : start + qlen].float()
        scores = torch.einsum("qhd,khd->hqk", qr, k) * scale
        # new token i may see keys 0..ctx+i
        key_pos = torch.arange(total, device=q.device)
        query_pos = ctx + torch.arange(qlen, device=q.device)
        hidden = key_pos[None, :] > query_pos[:, None]
        if window:
            hidden |= key_pos[None, :] <= query_pos[:, None] - window
        scores = scores.masked_fill(hidden[None], float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float()[:, None, None].expand(heads, qlen, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out[start : start + qlen] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start += qlen
    return out
