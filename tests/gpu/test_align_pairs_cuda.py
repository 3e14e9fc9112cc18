"""The alignment's Triton kernels (kernels/align_pairs.py) on a real GPU against the torch twin, at the
streamed steps' sizes (skipped without CUDA)."""

import pytest
import torch

from ferry.kernels.align_pairs import align_pairs_by_slot, align_pairs_by_slot_triton
from ferry.kernels.align_pairs_reference import align_pairs_by_slot_reference, max_aligned_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# (tokens, top_k, slots, block_m): issue 23's warm step over its staged positions and over the cache's
# slots, a 16,384-token step over a layer's 256 experts, a decode batch's block
@pytest.mark.parametrize(
    "tokens,top_k,slots,block_m", [(1248, 8, 176, 64), (1248, 8, 1318, 64), (16384, 8, 256, 64), (64, 8, 640, 16)]
)
@pytest.mark.parametrize("skewed", [False, True])
def test_the_kernels_give_the_twins_layout_and_never_wait_for_the_device(tokens, top_k, slots, block_m, skewed):
    g = torch.Generator(device="cuda").manual_seed(tokens + slots)
    topk = torch.randint(0, slots, (tokens, top_k), device="cuda", generator=g, dtype=torch.int32)
    if skewed:
        topk = torch.where(torch.rand(tokens, top_k, device="cuda", generator=g) < 0.7, topk % 5, topk)
    topk[torch.rand(tokens, top_k, device="cuda", generator=g) < 0.15] = -1
    want = align_pairs_by_slot_reference(topk, slots, block_m, None, block_starts=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation in the launches raises
    try:
        got = align_pairs_by_slot(topk, slots, block_m, None, block_starts=True)
        again = align_pairs_by_slot_triton(
            topk.long(), slots, block_m, max_aligned_blocks(topk.numel(), slots, block_m)
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b, c in zip(got, want, again):
        assert torch.equal(a, b) and torch.equal(a, c)
