"""Cases for the Triton grouped expert GEMM under TRITON_INTERPRET=1, run in a child process.

Triton decides at import time whether its @jit functions (its own standard library included)
are interpreted, so these cases cannot share a process with code that imported triton
normally; `test_grouped_expert_gemm.py` runs this file in a fresh interpreter with
TRITON_INTERPRET=1 and reports each case. Fresh random inputs per case; outputs poisoned first.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"

from tests.triton_interpreter_patch import install as install_interpreter_patch  # noqa: E402

install_interpreter_patch()

from long_step_rows import bf16_rows_are_the_float32_rows_rounded_once  # noqa: E402

from ferry.kernels.align_pairs import align_pairs_by_slot, align_pairs_by_slot_host  # noqa: E402
from ferry.kernels.aligned_blocks import block_m_for, launch_blocks  # noqa: E402
from ferry.kernels.expert_epilogue import GELU_TANH_AND_MUL, ExpertActivation  # noqa: E402
from ferry.kernels.expert_pair_gemv import expert_pair_rows_triton  # noqa: E402
from ferry.kernels.expert_rows_sum import sum_rows_triton  # noqa: E402
from ferry.kernels.grouped_expert_gemm import grouped_expert_rows_triton  # noqa: E402
from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_forward_reference, grouped_expert_rows_reference  # noqa: E402
from ferry.services.worker.expert_formats.bf16 import Bf16Experts  # noqa: E402
from ferry.services.worker.expert_formats.expert_shapes import ExpertBias  # noqa: E402


def make_case(seed, tokens, top_k, hidden, inter, slots, dtype, skip=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(slots, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(slots, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    topk = torch.stack([torch.randperm(slots, generator=g)[:top_k] for _ in range(tokens)])
    for _ in range(skip):  # some pairs skipped (slot -1), as when a layer is computed in groups
        topk[torch.randint(tokens, (1,), generator=g), torch.randint(top_k, (1,), generator=g)] = -1
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return x, topk, weights, w13, w2


def rows_match_in_float32(seed, tokens, top_k, hidden, inter, slots, skip):
    x, topk, weights, w13, w2 = make_case(seed, tokens, top_k, hidden, inter, slots, torch.float32, skip)
    got = torch.full((tokens, top_k, hidden), float("nan"))
    want = torch.full((tokens, top_k, hidden), float("nan"))
    grouped_expert_rows_triton(x, topk, weights, w13, w2, got)
    grouped_expert_rows_reference(x, topk, weights, w13, w2, want)
    skipped = topk < 0
    assert torch.isnan(got[skipped]).all(), "skipped pairs must be left untouched"
    assert not torch.isnan(got[~skipped]).any(), "every routed pair must be written"
    torch.testing.assert_close(got[~skipped], want[~skipped], rtol=1e-5, atol=1e-5)


def host_aligned_rows_match(seed, tokens, top_k, hidden, inter, slots, skip):
    """The offload store's way: alignment made on the host, handed to the kernel."""
    x, topk, weights, w13, w2 = make_case(seed, tokens, top_k, hidden, inter, slots, torch.float32, skip)
    sorted_pairs, block_slot = align_pairs_by_slot_host(topk.numpy(), block_m_for(topk.numel()))
    got = torch.full((tokens, top_k, hidden), float("nan"))
    want = torch.full((tokens, top_k, hidden), float("nan"))
    poisoned_slots = torch.full_like(topk, 10**6)  # must not be read when the alignment is given
    grouped_expert_rows_triton(
        x, poisoned_slots, weights, w13, w2, got, aligned=(torch.from_numpy(sorted_pairs), torch.from_numpy(block_slot))
    )
    grouped_expert_rows_reference(x, topk, weights, w13, w2, want)
    skipped = topk < 0
    assert torch.isnan(got[skipped]).all() and not torch.isnan(got[~skipped]).any()
    torch.testing.assert_close(got[~skipped], want[~skipped], rtol=1e-5, atol=1e-5)


def slot_window_computes_one_chunk_at_its_staging_slots(block_starts=False, skewed=False):
    """The streamed prefill's way: blocks aligned by position in a list of 9 experts, computed in
    chunks of 4 whose weights sit in a 4-slot bay elsewhere (slot_window): each pair exactly once,
    from its chunk's bay, as the reference computes it from the full list. `block_starts`: each
    chunk's launch sized for its own blocks, read from the aligned block starts; `skewed`: every
    token's first pair on position 0, so that chunk has more blocks than its launch has programs
    and they loop."""
    x, topk, weights, w13, w2 = make_case(14, 40, 3, 40, 24, 9, torch.float32, skip=0 if skewed else 5)
    if skewed:
        g = torch.Generator().manual_seed(15)
        topk = torch.stack(
            [torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(8, generator=g)[:2]]) for _ in range(40)]
        )
    block_m = block_m_for(topk.numel())
    aligned = align_pairs_by_slot(topk, 9, block_m, 9, block_starts=block_starts)
    if block_starts:
        sorted_pairs, block_slot, starts = aligned
        assert starts.tolist() == [int((block_slot < s).logical_and(block_slot >= 0).sum()) for s in range(10)]
        programs = launch_blocks(aligned, topk.numel(), block_m, (0, 4, 2))[3]
        assert programs < block_slot.numel(), "a window's launch must not span the layer's blocks"
        if skewed:
            assert int(starts[4] - starts[0]) > programs, "the skewed window must loop"
    want = torch.full((40, 3, 40), float("nan"))
    grouped_expert_rows_reference(x, topk, weights, w13, w2, want)
    got = torch.full((40, 3, 40), float("nan"))
    bay13, bay2 = torch.full((6, *w13.shape[1:]), float("nan")), torch.full((6, *w2.shape[1:]), float("nan"))
    for lo, hi, bay in ((0, 4, 2), (4, 8, 0), (8, 9, 1)):  # positions [lo, hi) land in slots bay..bay+hi-lo
        bay13[bay : bay + hi - lo], bay2[bay : bay + hi - lo] = w13[lo:hi], w2[lo:hi]
        grouped_expert_rows_triton(x, None, weights, bay13, bay2, got, aligned=aligned, slot_window=(lo, hi, bay - lo))
        bay13.fill_(float("nan"))  # a pair computed again from a stale bay would turn NaN
        bay2.fill_(float("nan"))
    skipped = topk < 0
    assert torch.isnan(got[skipped]).all() and not torch.isnan(got[~skipped]).any()
    torch.testing.assert_close(got[~skipped], want[~skipped], rtol=1e-5, atol=1e-5)


def a_window_outside_the_aligned_slots_is_refused():
    x, topk, weights, w13, w2 = make_case(16, 6, 2, 32, 16, 4, torch.float32)
    aligned = align_pairs_by_slot(topk, 4, block_m_for(topk.numel()), 4, block_starts=True)
    rows = torch.zeros(6, 2, 32)
    try:
        grouped_expert_rows_triton(x, None, weights, w13, w2, rows, aligned=aligned, slot_window=(2, 5, 0))
    except ValueError as e:
        assert "outside the 4 aligned slots" in str(e), e
    else:
        raise AssertionError("a window past the aligned slots must be refused")


def tight_grid_with_max_distinct_slots():
    """Many slots in the pool, few used: the grid bounded by the caller's distinct-slot count."""
    x, _, weights, w13, w2 = make_case(8, 40, 2, 32, 16, 30, torch.float32)
    g = torch.Generator().manual_seed(8)
    used = torch.randperm(30, generator=g)[:3]
    topk = torch.stack([used[torch.randperm(3, generator=g)[:2]] for _ in range(40)])
    got = torch.full((40, 2, 32), float("nan"))
    want = torch.full((40, 2, 32), float("nan"))
    grouped_expert_rows_triton(x, topk, weights, w13, w2, got, max_distinct_slots=3)
    grouped_expert_rows_reference(x, topk, weights, w13, w2, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def bfloat16_within_rounding():
    x, topk, weights, w13, w2 = make_case(3, 9, 2, 64, 32, 5, torch.bfloat16)
    got = torch.full((9, 2, 64), float("nan"))
    grouped_expert_rows_triton(x, topk, weights, w13, w2, got)
    out = got.sum(dim=1).to(torch.bfloat16).float()
    want = grouped_expert_forward_reference(x, topk, weights, w13, w2).float()
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


def alignment_groups_pairs_by_slot():
    topk = torch.tensor([[2, 0], [2, -1], [5, 2]])
    sorted_pairs, block_slot = align_pairs_by_slot(topk, num_slots=6, block_m=2)
    sentinel = topk.numel()
    real = block_slot[block_slot >= 0].tolist()
    assert real == [0, 2, 2, 5], real  # slot 0: 1 pair (1 block), slot 2: 3 pairs (2 blocks), slot 5: 1
    rows = sorted_pairs[: 2 * len(real)].tolist()
    assert rows == [1, sentinel, 0, 2, 5, sentinel, 4, sentinel], rows
    assert (block_slot[len(real) :] == -1).all()


def pair_kernel_matches(seed, tokens, top_k, hidden, inter, slots, skip, offset):
    """The pair-by-pair kernel (small steps): ragged shapes (blocks past H and I masked), skipped
    pairs untouched, and the slot offset the all-resident store passes instead of adding it."""
    x, topk, weights, w13, w2 = make_case(seed, tokens, top_k, hidden, inter, slots + offset, torch.float32, skip)
    topk = torch.where(topk >= 0, topk % slots, -1)  # ids of one "layer"; its slots start at offset
    got = torch.full((tokens, top_k, hidden), float("nan"))
    want = torch.full((tokens, top_k, hidden), float("nan"))
    expert_pair_rows_triton(x, topk, weights, w13, w2, got, slot_offset=offset)
    grouped_expert_rows_reference(x, torch.where(topk >= 0, topk + offset, -1), weights, w13, w2, want)
    skipped = topk < 0
    assert torch.isnan(got[skipped]).all(), "skipped pairs must be left untouched"
    assert not torch.isnan(got[~skipped]).any(), "every routed pair must be written"
    torch.testing.assert_close(got[~skipped], want[~skipped], rtol=1e-5, atol=1e-5)


def pair_kernel_groups_give_the_same_bits():
    """A layer computed in two groups (the offload store) equals it computed at once (all-resident)."""
    x, topk, weights, w13, w2 = make_case(11, 3, 4, 200, 150, 9, torch.bfloat16)
    at_once = torch.full((3, 4, 200), float("nan"))
    expert_pair_rows_triton(x, topk.to(torch.int32), weights, w13, w2, at_once)
    first = torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) < 0.5
    grouped = torch.full((3, 4, 200), float("nan"))
    expert_pair_rows_triton(x, torch.where(first, topk, -1), weights, w13, w2, grouped)
    expert_pair_rows_triton(x, torch.where(first, -1, topk), weights, w13, w2, grouped)
    assert torch.equal(at_once, grouped)
    want = grouped_expert_forward_reference(x, topk, weights, w13, w2).float()
    torch.testing.assert_close(at_once.sum(dim=1).to(torch.bfloat16).float(), want, rtol=2e-2, atol=2e-2)


def rows_summed_in_k_order():
    """The stores' last step: float32 rows added in k order (exactly, in float32), cast last."""
    g = torch.Generator().manual_seed(21)
    rows = torch.randn(3, 5, 1500, generator=g)  # H past one block: the masked tail
    want = rows[:, 0].clone()
    for j in range(1, 5):
        want = want + rows[:, j]
    got = sum_rows_triton(rows, torch.float32, out=torch.full((3, 1500), float("nan")))
    assert torch.equal(got, want)
    bf16 = sum_rows_triton(rows, torch.bfloat16, out=torch.full((3, 1500), float("nan"), dtype=torch.bfloat16))
    torch.testing.assert_close(bf16.float(), want, rtol=1e-2, atol=1e-2)


def biased_clamped_slots(seed, hidden, inter, slots, dtype):
    """gpt-oss's slots: the bf16 format's rows with biases after the weights (ragged bias rows when 2I or H is
    not a multiple of the other side), written as the loader writes them, and their EpilogueFamily views with
    the clamped SwiGLU at a limit the projections reach."""
    g = torch.Generator().manual_seed(seed)
    b13, b2 = -(-2 * inter // hidden), -(-hidden // inter)
    fmt = Bf16Experts(hidden, inter, dtype, (b13, b2), ExpertActivation(swiglu_limit=1.0, swiglu_alpha=1.702))
    (shape13, _), (shape2, _) = fmt.row_shapes()
    w13 = torch.full((slots, *shape13), float("nan"), dtype=dtype)
    w2 = torch.full((slots, *shape2), float("nan"), dtype=dtype)
    for s in range(slots):
        gate, up = (torch.randn(2, inter, hidden, generator=g) * hidden**-0.5).to(dtype)
        down = (torch.randn(hidden, inter, generator=g) * inter**-0.5).to(dtype)
        bias = ExpertBias(
            (0.5 * torch.randn(2 * inter, generator=g)).to(dtype), (0.5 * torch.randn(hidden, generator=g)).to(dtype)
        )
        fmt.write_expert(w13[s], w2[s], gate, up, down, f"slot {s}", bias)
    return fmt.gemm_views(w13, w2)


def gelu_slots(seed, hidden, inter, slots, dtype):
    """Gemma 4's slots: the bf16 format's rows without biases, viewed with the gelu-tanh activation."""
    g = torch.Generator().manual_seed(seed)
    fmt = Bf16Experts(hidden, inter, dtype, (0, 0), GELU_TANH_AND_MUL)
    w13 = (torch.randn(slots, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(slots, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    return fmt.gemm_views(w13, w2)


def epilogue_rows_match(kernel, seed, tokens, top_k, hidden, inter, slots, skip, dtype, gelu=False):
    """Biases and the clamped SwiGLU (or, `gelu`, Gemma's gelu-tanh experts): the grouped GEMM or the pair kernel
    against the twin, every pair once."""
    x, topk, weights, _, _ = make_case(seed, tokens, top_k, hidden, inter, slots, dtype, skip)
    slots_of = gelu_slots if gelu else biased_clamped_slots
    g13, g2 = slots_of(seed, hidden, inter, slots, dtype)
    got = torch.full((tokens, top_k, hidden), float("nan"))
    want = torch.full((tokens, top_k, hidden), float("nan"))
    if kernel == "pair":
        expert_pair_rows_triton(x, topk, weights, g13, g2, got)
    else:
        grouped_expert_rows_triton(x, topk, weights, g13, g2, got)
    grouped_expert_rows_reference(x, topk, weights, g13, g2, want)
    skipped = topk < 0
    assert torch.isnan(got[skipped]).all() and not torch.isnan(got[~skipped]).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[~skipped], want[~skipped], rtol=tol, atol=tol)
    plain = torch.full_like(want, float("nan"))
    grouped_expert_rows_reference(x, topk, weights, g13.weight, getattr(g2, "weight", g2), plain)
    assert not torch.allclose(plain[~skipped], want[~skipped], atol=1e-2), "the epilogue changed nothing"


CASES = {
    "epilogue_grouped_float32": lambda: epilogue_rows_match("grouped", 20, 37, 3, 48, 40, 6, 4, torch.float32),
    "epilogue_grouped_bfloat16": lambda: epilogue_rows_match("grouped", 21, 20, 2, 64, 32, 5, 2, torch.bfloat16),
    "epilogue_pair_float32": lambda: epilogue_rows_match("pair", 22, 5, 3, 300, 170, 7, 3, torch.float32),
    "epilogue_pair_bfloat16": lambda: epilogue_rows_match("pair", 23, 3, 4, 64, 48, 8, 0, torch.bfloat16),
    "gelu_grouped_float32": lambda: epilogue_rows_match("grouped", 24, 37, 3, 48, 40, 6, 4, torch.float32, True),
    "gelu_grouped_bfloat16": lambda: epilogue_rows_match("grouped", 25, 20, 2, 64, 32, 5, 2, torch.bfloat16, True),
    "gelu_pair_float32": lambda: epilogue_rows_match("pair", 26, 5, 3, 300, 170, 7, 3, torch.float32, True),
    "gelu_pair_bfloat16": lambda: epilogue_rows_match("pair", 27, 3, 4, 64, 48, 8, 0, torch.bfloat16, True),
    "rows_summed_in_k_order": rows_summed_in_k_order,
    "pair_kernel_decode_one_token": lambda: pair_kernel_matches(12, 1, 8, 64, 48, 16, 0, 0),
    "pair_kernel_ragged_skipped_offset": lambda: pair_kernel_matches(13, 5, 3, 300, 170, 7, 3, 14),
    "pair_kernel_groups_give_the_same_bits": pair_kernel_groups_give_the_same_bits,
    "decode_one_token": lambda: rows_match_in_float32(0, 1, 2, 32, 16, 4, 0),
    "ragged_shapes_and_skipped_pairs": lambda: rows_match_in_float32(1, 5, 3, 48, 40, 7, 2),
    "several_blocks_of_one_slot": lambda: rows_match_in_float32(2, 37, 4, 80, 72, 6, 5),
    "host_aligned_rows": lambda: host_aligned_rows_match(6, 70, 3, 40, 24, 9, 7),
    "slot_window_computes_one_chunk_at_its_staging_slots": slot_window_computes_one_chunk_at_its_staging_slots,
    "slot_window_with_block_starts": lambda: slot_window_computes_one_chunk_at_its_staging_slots(block_starts=True),
    "slot_window_with_block_starts_skewed_loops": lambda: slot_window_computes_one_chunk_at_its_staging_slots(
        block_starts=True, skewed=True
    ),
    "a_window_outside_the_aligned_slots_is_refused": a_window_outside_the_aligned_slots_is_refused,
    "tight_grid_with_max_distinct_slots": tight_grid_with_max_distinct_slots,
    "bfloat16_within_rounding": bfloat16_within_rounding,
    "alignment_groups_pairs_by_slot": alignment_groups_pairs_by_slot,
    "bf16_rows_are_the_float32_rows_rounded_once": lambda: bf16_rows_are_the_float32_rows_rounded_once(
        *make_case(17, 40, 3, 64, 32, 9, torch.bfloat16, skip=5), num_slots=9, window=4
    ),
}


def main() -> None:
    results = {}
    for name, case in CASES.items():
        try:
            case()
            results[name] = None
        except Exception:  # noqa: BLE001 - every failure is reported to the parent test
            results[name] = traceback.format_exc()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
