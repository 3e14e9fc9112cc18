"""Reference twin of paged attention: each request's K/V gathered from its pages, then plain
causal attention with grouped-query heads, in float32.

Token t of request r sits at position context_len[r] + i (i = its index among the request's new
tokens) and attends to positions 0..that position: the cached context plus the new tokens up to
itself. The caller has already written the new tokens' K/V into the pages (`write_kv`), so the
pages are the only source of keys and values, exactly as for the Triton kernel."""

from __future__ import annotations

import torch

from ferry.shared.units import ceil_div


def write_kv(
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [T]: flat row page * page_size + offset
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,
) -> None:
    """Store the new tokens' K/V at their rows; views keep the pool's storage, so this writes in place."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_request_kv(cache: torch.Tensor, pages: torch.Tensor, length: int,
                      into: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The first `length` positions of one request, [length, kv_heads, head_dim], read through its page list;
    into `into`'s first pages ([pages, page_size, kv_heads, head_dim]) where it has room, else a new tensor."""
    page_size = cache.shape[1]
    needed = ceil_div(length, page_size)
    index = pages[:needed].long()
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
) -> torch.Tensor:
    heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    start = 0
    for r, (qlen, ctx) in enumerate(zip(query_lens, context_lens)):
        total = ctx + qlen
        k = gather_request_kv(k_cache, page_table[r], total).float().repeat_interleave(group, dim=1)
        v = gather_request_kv(v_cache, page_table[r], total).float().repeat_interleave(group, dim=1)
        qr = q[start : start + qlen].float()
        scores = torch.einsum("qhd,khd->hqk", qr, k) * scale
        # new token i may see keys 0..ctx+i
        key_pos = torch.arange(total, device=q.device)
        query_pos = ctx + torch.arange(qlen, device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + qlen] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start += qlen
    return out
