"""Transparent huge pages for the host benches' expert banks (issue 25: does the host kernel read faster from them?).

The worker's banks are ordinary anonymous memory page-locked in place (`host_banks.pinnable_host_block`), so
where the host's THP mode is `madvise` (this CPU machine's) they sit on 4 KiB pages: an expert of the 35B
(~6 MB) spans ~1,500 pages, each a TLB miss, and the hardware prefetcher stops at every page's end. Where the
mode is `always` the kernel backs them with 2 MiB pages when it finds free ones, which would make the host's
time an expert depend on how fragmented memory was when the server started; on the H200 the host nodes'
time an expert moved 80-342 µs from server to server (bench/NOTES.md, "Two decode steps ahead"). This lets
`bench/host_price_tokens.py --huge-pages` time the same kernel on banks advised onto huge pages, and records
the mode and how much of the process huge pages back, before any worker change is made on a guess.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>
PAGE = 4096
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The host's THP mode (the bracketed word of `always [madvise] never`), None where there is none."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def anon_huge_bytes(pid: int | str = "self") -> int | None:
    """Bytes of the process's anonymous memory that huge pages back (AnonHugePages of smaps_rollup)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def advise_huge_pages(blocks: list[torch.Tensor]) -> int:
    """madvise(MADV_HUGEPAGE) over the whole pages of each block, which must not have been written yet
    (pages already faulted in stay small until khugepaged collapses them). Returns the bytes advised;
    raises OSError with the errno where the kernel refuses (no THP support)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    advised = 0
    for block in blocks:
        start = (block.data_ptr() + PAGE - 1) & ~(PAGE - 1)
        length = (block.data_ptr() + block.nbytes - start) & ~(PAGE - 1)
        if length <= 0:
            continue
        if libc.madvise(start, length, MADV_HUGEPAGE) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_HUGEPAGE) failed: {os.strerror(err)}")
        advised += length
    return advised


def bank_blocks(banks) -> list[torch.Tensor]:
    """The host blocks of HostBanks (w13, w2) or PackedHostBanks (its low, high and base planes)."""
    names = ("lo", "hi", "base") if getattr(banks, "packed", False) else ("w13", "w2")
    return [t for name in names for t in getattr(banks, name)]
