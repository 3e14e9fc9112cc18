"""Huge pages in the host benches: which blocks a bank has, and the A/B the worker's advice was landed on.

The worker advises every bank block onto transparent huge pages (services/worker/offload/host_memory/huge_pages.py,
FERRY_HOST_HUGE_PAGES). `bench/host_price_tokens.py --huge-pages on|off` times the host kernel on a bank
allocated with the advice and without it, and records the host's THP mode and how much of the process huge
pages backed: on the H200 the host nodes' time an expert had moved 80-342 µs from server to server
(bench/NOTES.md, "Two decode steps ahead"), which 4 KiB pages fragmented differently would explain.
"""

from __future__ import annotations

from ferry.services.worker.offload.host_memory.huge_pages import (
    advise_huge_pages,
    anon_huge_bytes,
    thp_mode,
)

__all__ = ["advise_huge_pages", "anon_huge_bytes", "bank_blocks", "thp_mode"]


def bank_blocks(banks) -> list:
    """The host blocks of HostBanks (w13, w2) or PackedHostBanks (its low, high and base planes)."""
    names = ("lo", "hi", "base") if getattr(banks, "packed", False) else ("w13", "w2")
    return [t for name in names for t in getattr(banks, name)]
