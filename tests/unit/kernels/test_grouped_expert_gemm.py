"""The Triton grouped expert GEMM against its reference twin: on CPU through TRITON_INTERPRET=1
(small shapes), fresh random inputs every case, outputs poisoned with NaN first."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from kernels.moe_reference import grouped_expert_forward_reference, grouped_expert_rows_reference

KERNEL_FILE = Path(__file__).resolve().parents[3] / "kernels" / "grouped_expert_gemm.py"


@pytest.fixture(scope="module")
def kernel():
    """The kernel module compiled for the interpreter. Triton decides at decoration time (and
    again while launching) whether to interpret, so TRITON_INTERPRET=1 is set for this module's
    tests and a private copy of the kernel module is loaded under it; the copy in sys.modules
    (used by the CPU paths, which never launch Triton) is left alone."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("grouped_expert_gemm_interpreted", KERNEL_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _case(seed, tokens, top_k, hidden, inter, slots, dtype, skip=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(slots, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(slots, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    topk = torch.stack([torch.randperm(slots, generator=g)[:top_k] for _ in range(tokens)])
    for _ in range(skip):  # some pairs skipped (slot -1), as when a layer is computed in groups
        topk[torch.randint(tokens, (1,), generator=g), torch.randint(top_k, (1,), generator=g)] = -1
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return x, topk, weights, w13, w2


@pytest.mark.parametrize(
    "seed,tokens,top_k,hidden,inter,slots,skip",
    [
        (0, 1, 2, 32, 16, 4, 0),  # decode: one token
        (1, 5, 3, 48, 40, 7, 2),  # ragged shapes (not multiples of the blocks), skipped pairs
        (2, 37, 4, 80, 72, 6, 5),  # more pairs than a block per slot: several blocks of one slot
    ],
)
def test_rows_match_the_reference_in_float32(kernel, seed, tokens, top_k, hidden, inter, slots, skip):
    x, topk, weights, w13, w2 = _case(seed, tokens, top_k, hidden, inter, slots, torch.float32, skip)
    got = torch.full((tokens, top_k, hidden), float("nan"))
    want = torch.full((tokens, top_k, hidden), float("nan"))
    kernel.grouped_expert_rows_triton(x, topk, weights, w13, w2, got)
    grouped_expert_rows_reference(x, topk, weights, w13, w2, want)
    skipped = topk < 0
    assert torch.isnan(got[skipped]).all(), "skipped pairs must be left untouched"
    assert not torch.isnan(got[~skipped]).any(), "every routed pair must be written"
    torch.testing.assert_close(got[~skipped], want[~skipped], rtol=1e-5, atol=1e-5)


def test_bfloat16_matches_the_reference_within_rounding(kernel):
    x, topk, weights, w13, w2 = _case(3, 9, 2, 64, 32, 5, torch.bfloat16)
    got = torch.full((9, 2, 64), float("nan"))
    kernel.grouped_expert_rows_triton(x, topk, weights, w13, w2, got)
    want = grouped_expert_forward_reference(x, topk, weights, w13, w2)
    out = got.sum(dim=1).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert (out.float() - want.float()).abs().max() < 0.1 * want.float().abs().max()


def test_alignment_groups_pairs_by_slot_padded_to_blocks(kernel):
    topk = torch.tensor([[2, 0], [2, -1], [5, 2]])
    sorted_pairs, block_slot = kernel.align_pairs_by_slot(topk, num_slots=6, block_m=2)
    sentinel = topk.numel()
    real = block_slot[block_slot >= 0].tolist()
    assert real == [0, 2, 2, 5]  # slot 0: 1 pair (1 block), slot 2: 3 pairs (2 blocks), slot 5: 1
    rows = sorted_pairs[: 2 * len(real)].tolist()
    assert rows == [1, sentinel, 0, 2, 5, sentinel, 4, sentinel]
    assert (block_slot[len(real):] == -1).all()


def test_dispatch_uses_the_reference_on_cpu():
    from kernels.grouped_expert_gemm import grouped_expert_forward

    x, topk, weights, w13, w2 = _case(4, 6, 2, 16, 8, 4, torch.float32)
    assert torch.equal(grouped_expert_forward(x, topk, weights, w13, w2),
                       grouped_expert_forward_reference(x, topk, weights, w13, w2))  # fmt: skip


def test_the_result_does_not_depend_on_slot_numbering():
    """The property the offload cache relies on: the same experts in other slots give the same bits."""
    x, topk, weights, w13, w2 = _case(5, 11, 4, 24, 16, 8, torch.float32)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(9))  # expert s now lives in slot perm[s]
    w13p, w2p = torch.empty_like(w13), torch.empty_like(w2)
    w13p[perm], w2p[perm] = w13, w2
    a = grouped_expert_forward_reference(x, topk, weights, w13, w2)
    b = grouped_expert_forward_reference(x, perm[topk], weights, w13p, w2p)
    assert torch.equal(a, b)
