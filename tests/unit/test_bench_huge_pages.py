"""bench/huge_pages.py: the THP mode is read from its sysfs word, a block is advised over exactly its whole
pages, and a bank's advised blocks are filled and computed as before (bench/host_price_tokens.py --huge-pages)."""

from __future__ import annotations

import sys

import pytest
import torch

from bench.huge_pages import PAGE, advise_huge_pages, anon_huge_bytes, bank_blocks, thp_mode

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")


def test_the_thp_mode_is_the_bracketed_word(tmp_path):
    for text, mode in (("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
                       ("always madvise [never]\n", "never"), ("garbled\n", None)):  # fmt: skip
        (tmp_path / "enabled").write_text(text)
        assert thp_mode(tmp_path / "enabled") == mode
    assert thp_mode(tmp_path / "absent") is None


@linux
def test_a_block_is_advised_over_its_whole_pages_only():
    block = torch.empty(8 * PAGE + 100, dtype=torch.uint8)
    start = -block.data_ptr() % PAGE  # the first whole page's offset
    advised = advise_huge_pages([block, torch.empty(0, dtype=torch.uint8)])
    assert advised % PAGE == 0 and advised == (block.nbytes - start) // PAGE * PAGE
    assert isinstance(anon_huge_bytes(), int)


@linux
@pytest.mark.parametrize("fmt", ["bf16", "packed"])
def test_advised_banks_hold_and_compute_the_same_experts(fmt):
    from bench.cpu_expert_bw import format_banks
    from ferry.services.worker.offload.host_experts import HostExperts

    plain, advised = (format_banks(fmt, 64, 32, 4, huge_pages=h) for h in (False, True))
    assert len(bank_blocks(advised)) == (3 if fmt == "packed" else 2)
    for a, b in zip(bank_blocks(plain), bank_blocks(advised)):
        assert torch.equal(a, b)
    x = torch.randn(2, 64).to(torch.bfloat16)
    pairs = [(0, 1, 1.0), (1, 3, 0.5)]
    outs = []
    for banks in (plain, advised):
        host = HostExperts(banks, torch.bfloat16, 1)
        outs.append(host.compute(0, x, pairs))
        host.close()
    assert torch.equal(outs[0], outs[1])
