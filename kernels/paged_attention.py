"""Paged attention dispatch: on CUDA the Triton decode kernel when every request brings at most
SHORT_QUERY_TOKENS tokens (decode steps, speculative verify rows), else FlashAttention for each request with a
long query (kernels/paged_attention_flash.py: its K/V gathered from the pages) and the blocked Triton prefill
kernel for the rest; the reference twin elsewhere.
Attention with sinks or a sliding window (gpt-oss) takes the Triton kernels only: SDPA has no sink term.
A sliding group kept in rings (plan/kv_groups.py) is read through the requests' slots, not a page table."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import structlog
import torch

from ferry.kernels.dispatch import use_triton
from ferry.kernels.paged_attention_flash import flash_available, flash_prefill_into, flash_requests
from ferry.kernels.paged_attention_reference import paged_attention_reference, write_kv

__all__ = ["paged_attention", "write_kv"]

# the longest query the decode kernel takes (one program a token, each over its own keys): a verify row's
# K + 1 positions and a hybrid's kept drafts computed again (2K + 1 at K = 8) run as a decode step's tokens do, with
# no host-built block list, so a CUDA graph can hold them; a longer query shares its key reads in the prefill kernel
SHORT_QUERY_TOKENS = 17

log = structlog.get_logger("worker.attention")
_refusals_logged: set[tuple] = set()


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [pages, page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    page_table: torch.Tensor,  # int32 [R, max_pages]
    query_start: torch.Tensor,  # int32 [R + 1]
    positions: torch.Tensor,  # int64 [T]
    query_lens: list[int],
    context_lens: list[int],
    scale: float,
    token_request: torch.Tensor | None = None,  # int [T]: each token's request (decode kernel), optional
    gather: Callable[[], tuple[torch.Tensor, torch.Tensor] | None] | None = None,  # FlashAttention's K/V buffers
    k_scale: torch.Tensor | None = None,  # an fp8 pool's scales, [pages, page_size, kv_heads] float32
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,  # [heads]: a logit per head in each softmax's denominator
    window: int = 0,  # > 0: each token attends to the last `window` keys (itself included) only
    ring_pages: int = 0,  # > 0: the caches are a sliding group's rings (plan/kv_groups.py) of this many pages
    ring_slots: torch.Tensor | None = None,  # int [R]: with ring_pages, each request's slot (no page table)
) -> torch.Tensor:
    if ring_pages:
        if ring_slots is None or not window:
            raise ValueError("a ring (ring_pages > 0) needs the requests' slots (ring_slots) and a window")
        page_table = ring_slots
    if not use_triton(q):
        return paged_attention_reference(
            q,
            k_cache,
            v_cache,
            page_table,
            query_lens,
            context_lens,
            scale,
            k_scale,
            v_scale,
            sinks,
            window,
            ring_pages,
        )
    from ferry.kernels import paged_attention_triton as triton_kernels

    scales = dict(k_scale=k_scale, v_scale=v_scale)
    extra = dict(sinks=sinks, window=window, ring_pages=ring_pages)
    if max(query_lens, default=0) <= SHORT_QUERY_TOKENS:  # decode, a verify row: each token its own program
        return triton_kernels.paged_attention_decode_triton(
            q,
            k_cache,
            v_cache,
            page_table,
            query_start,
            positions,
            scale,
            token_request=token_request,
            **scales,
            **extra,
        )
    flash: set[int] = set()
    out = torch.empty_like(q)
    if sinks is None and not window and flash_available(q, k_cache):
        first_rows = [0, *itertools.accumulate(query_lens)]
        long_queries = flash_requests(query_lens)
        buffers = gather() if gather is not None and long_queries else None
        for r in long_queries:
            if flash_prefill_into(
                out,
                q,
                k_cache,
                v_cache,
                page_table[r],
                first_rows[r],
                query_lens[r],
                context_lens[r],
                scale,
                buffers,
                **scales,
            ):
                flash.add(r)
            else:
                _flash_refused(q, k_cache, query_lens[r], context_lens[r])
    if len(flash) == sum(1 for n in query_lens if n):
        return out
    return triton_kernels.paged_attention_prefill_triton(
        q,
        k_cache,
        v_cache,
        page_table,
        query_start,
        positions,
        query_lens,
        scale,
        out=out,
        skip=frozenset(flash),
        **scales,
        **extra,
    )


def _flash_refused(q: torch.Tensor, k_cache: torch.Tensor, query_len: int, context_len: int) -> None:
    """FlashAttention refused a long query it was expected to take: the paged kernel computes it, correctly
    but at about two thirds of the speed. Said once per kind of call, so that a refusal
    that would silently cost every long prefill shows in the log (one did, unseen, until a profile)."""
    kind = (q.dtype, k_cache.dtype, tuple(q.shape[1:]), k_cache.shape[2], context_len > 0)
    if kind in _refusals_logged:
        return
    _refusals_logged.add(kind)
    log.warning(
        "flash_attention_refused",
        query_tokens=query_len,
        context_tokens=context_len,
        dtype=str(q.dtype),
        cache_dtype=str(k_cache.dtype),
        heads=q.shape[1],
        kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
    )
