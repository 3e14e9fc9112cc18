"""Huge pages for the host banks (services/worker/offload/host_memory/huge_pages.py): the
THP mode is read from its sysfs word, a block is advised over exactly its whole pages, every bank block
of a huge page or more is advised as the worker allocates it (FERRY_HOST_HUGE_PAGES=0: none), and advised
banks hold and compute the same experts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from ferry.services.worker.offload.host_memory import host_banks
from ferry.services.worker.offload.host_memory.host_banks import HostBanks, pinnable_host_block
from ferry.services.worker.offload.host_memory.huge_pages import (
    HUGE_PAGE,
    PAGE,
    advise_huge_pages,
    anon_huge_bytes,
    thp_mode,
)
from ferry.services.worker.offload.host_memory.packed_banks import PackedHostBanks

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")


def test_the_thp_mode_is_the_bracketed_word(tmp_path):
    for text, mode in (
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("garbled\n", None),
    ):
        (tmp_path / "enabled").write_text(text)
        assert thp_mode(tmp_path / "enabled") == mode
    assert thp_mode(tmp_path / "absent") is None


@linux
def test_a_block_is_advised_over_its_whole_pages_only():
    block = torch.empty(8 * PAGE + 100, dtype=torch.uint8)
    start = -block.data_ptr() % PAGE  # the first whole page's offset
    assert advise_huge_pages(torch.empty(0, dtype=torch.uint8)) == 0
    assert advise_huge_pages(block, smallest=HUGE_PAGE) == 0  # under a huge page: left alone
    advised = advise_huge_pages(block)
    assert advised % PAGE == 0 and advised == (block.nbytes - start) // PAGE * PAGE
    assert isinstance(anon_huge_bytes(), int)


def _advised(block: torch.Tensor) -> bool:
    """Whether the mapping that holds the block's middle carries the huge-page advice (VmFlags `hg`)."""
    at, flags = block.data_ptr() + block.nbytes // 2, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= at < hi
        elif head == "VmFlags:" and inside:
            flags = line.split()[1:]
    assert flags is not None, "the block's mapping was not found in smaps"
    return "hg" in flags


@linux
@pytest.mark.skipif(thp_mode() in (None, "never"), reason="no transparent huge pages on this kernel")
def test_bank_blocks_are_advised_as_the_worker_allocates_them(monkeypatch):
    # 64 MiB blocks, never touched: above glibc's largest mmap threshold, so each is a mapping of its own
    # (a smaller one may reuse heap that an advised block left behind, advice and all)
    monkeypatch.delenv("FERRY_HOST_HUGE_PAGES", raising=False)
    big = pinnable_host_block((32, HUGE_PAGE), torch.uint8, pin=False)  # the default: advised
    assert _advised(big)
    assert not _advised(pinnable_host_block((32, HUGE_PAGE), torch.uint8, pin=False, huge_pages=False))
    monkeypatch.setenv("FERRY_HOST_HUGE_PAGES", "0")
    assert not _advised(pinnable_host_block((32, HUGE_PAGE), torch.uint8, pin=False))
    assert _advised(pinnable_host_block((32, HUGE_PAGE), torch.uint8, pin=False, huge_pages=True))


@linux
@pytest.mark.parametrize("allocate", [HostBanks.allocate, PackedHostBanks.allocate], ids=["plain", "packed"])
def test_the_banks_huge_pages_argument_overrides_the_environment_and_leaves_it_alone(monkeypatch, allocate):
    """The benches' A/B allocates banks advised and not by an argument: the worker's environment variable
    stays what it was (a process-wide setting changed for one allocation would reach any other thread's)."""
    offered = []
    monkeypatch.setattr(host_banks, "advise_huge_pages", lambda block, smallest: offered.append(block) or 0)

    def blocks(**kwargs) -> int:
        before = len(offered)
        allocate(1, 4, 512, 512, dtype=torch.bfloat16, pin=False, progress=False, **kwargs)
        return len(offered) - before

    monkeypatch.setenv("FERRY_HOST_HUGE_PAGES", "0")
    environ = dict(os.environ)
    assert blocks() == 0
    assert blocks(huge_pages=True) > 0
    assert dict(os.environ) == environ
    monkeypatch.setenv("FERRY_HOST_HUGE_PAGES", "1")
    environ = dict(os.environ)
    assert blocks() > 0
    assert blocks(huge_pages=False) == 0
    assert dict(os.environ) == environ


def format_banks(fmt: str, hidden: int, inter: int, experts: int, huge_pages: bool):
    """One MoE layer of `experts` host experts (bf16 or packed) with --load-format dummy's weights, its blocks
    advised onto transparent huge pages as the worker's are, or (False) left on small pages."""
    if fmt == "packed":
        banks = PackedHostBanks.allocate(1, experts, hidden, inter, pin=False, progress=False, huge_pages=huge_pages)
    else:
        banks = HostBanks.allocate(
            1, experts, hidden, inter, torch.bfloat16, pin=False, progress=False, huge_pages=huge_pages
        )
    banks.fill_dummy(seed=0, progress=False)
    banks.seal()
    return banks


def bank_blocks(banks) -> list:
    """The host blocks of HostBanks (w13, w2) or PackedHostBanks (its low, high and base planes)."""
    names = ("lo", "hi", "base") if getattr(banks, "packed", False) else ("w13", "w2")
    return [t for name in names for t in getattr(banks, name)]


@linux
@pytest.mark.parametrize("fmt", ["bf16", "packed"])
def test_advised_banks_hold_and_compute_the_same_experts(fmt):
    from ferry.services.worker.offload.host_compute.host_experts import HostExperts

    # 512 x 512, 4 experts: each bank's first block spans a huge page (w13 4 MiB, packed lo 3 MiB)
    plain, advised = (format_banks(fmt, 512, 512, 4, huge_pages=h) for h in (False, True))
    assert len(bank_blocks(advised)) == (3 if fmt == "packed" else 2)
    if thp_mode() not in (None, "never"):
        assert _advised(bank_blocks(advised)[0])  # (plain's may sit in heap a freed advised block left)
    for a, b in zip(bank_blocks(plain), bank_blocks(advised)):
        assert torch.equal(a, b)
    x = torch.randn(2, 512).to(torch.bfloat16)
    pairs = [(0, 1, 1.0), (1, 3, 0.5)]
    outs = []
    for banks in (plain, advised):
        host = HostExperts(banks, torch.bfloat16, 1)
        outs.append(host.compute(0, x, pairs))
        host.close()
    assert torch.equal(outs[0], outs[1])
