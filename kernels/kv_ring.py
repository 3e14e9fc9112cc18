"""Addressing a sliding KV group's rings (plan/kv_groups.py) in torch: the rows the new tokens write, and the page
table the reference twin reads through. Position p of the request in slot s lives in ring page
s x ring_pages + (p // page_size) mod ring_pages (kv_groups.ring_page), at row p mod page_size of it; the Triton
kernels (kernels/paged_attention_triton.py, `_paged_kv_block`) compute the same from the slot."""

from __future__ import annotations

import torch


def ring_rows(
    positions: torch.Tensor,  # int64 [T]
    token_slots: torch.Tensor,  # int [T]: the request slot of each token
    ring_pages: int,
    page_size: int,
) -> torch.Tensor:
    """The flat KV row (page x page_size + offset) each new token writes in its request's ring, int64 [T]."""
    pages = token_slots.long() * ring_pages + torch.remainder(positions // page_size, ring_pages)
    return pages * page_size + positions % page_size


def ring_page_table(slots: torch.Tensor, ring_pages: int, num_pages: int) -> torch.Tensor:
    """[R, num_pages] int64: the ring page of each of the first `num_pages` pages of positions of the requests in
    `slots` [R], a page table as a paged group's (its columns past ring_pages wrap around)."""
    columns = torch.remainder(torch.arange(num_pages, device=slots.device), ring_pages)
    return slots.long()[:, None] * ring_pages + columns[None, :]
