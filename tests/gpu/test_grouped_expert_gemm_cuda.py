"""The Triton grouped expert GEMM on a real GPU against its reference twin (skipped without CUDA)."""

import pytest
import torch

from ferry.kernels.grouped_expert_gemm import grouped_expert_forward, grouped_expert_rows
from ferry.kernels.grouped_expert_gemm_reference import grouped_expert_forward_reference, grouped_expert_rows_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("tokens", [1, 8, 64, 2048])  # decode batches and a prefill chunk
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_the_reference_at_real_shapes(tokens, dtype):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    hidden, inter, slots, top_k = 2048, 768, 160, 8  # Qwen3-30B-A3B expert shapes
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(dtype)
    w13 = (torch.randn(slots, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(slots, hidden, inter, device="cuda", generator=g) * inter**-0.5).to(dtype)
    scores = torch.rand(tokens, slots, device="cuda", generator=g)
    topk = scores.topk(top_k, dim=-1).indices
    topk[0, -1] = -1  # a skipped pair stays untouched
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=g), dim=-1)
    got = torch.full((tokens, top_k, hidden), float("nan"), device="cuda")
    want = torch.full_like(got, float("nan"))
    grouped_expert_rows(x, topk, weights, w13, w2, got)
    grouped_expert_rows_reference(x, topk, weights, w13, w2, want)
    assert torch.isnan(got[0, -1]).all() and not torch.isnan(got[topk >= 0]).any()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[topk >= 0], want[topk >= 0], rtol=tol, atol=tol)
    full = scores.topk(top_k, dim=-1).indices  # every pair routed: the summed output
    out = grouped_expert_forward(x, full, weights, w13, w2)
    ref = grouped_expert_forward_reference(x, full, weights, w13, w2)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def _staged_layer(fmt, tokens, experts, staged, top_k, skewed, g):
    """A streamed layer of the 35B's expert shapes: `staged` of `experts` experts in the ring (positions
    0..staged-1, the rest -1: cached or the host's), the staged weights in a bay family of 12 slots."""
    from ferry.kernels.align_pairs import align_pairs_by_slot
    from ferry.kernels.aligned_blocks import block_m_for

    hidden, inter = 2048, 512
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, device="cuda", generator=g)
    if skewed:  # a real router's favourite: expert 0 in every token's top k
        scores[:, 0] = 2.0
    ids = scores.topk(top_k, dim=-1).indices
    order = torch.randperm(experts, device="cuda", generator=g)
    if skewed:  # and staged first: the first window holds it
        order = torch.cat([order[order == 0], order[order != 0]])
    position = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
    position[order[:staged]] = torch.arange(staged, dtype=torch.int32, device="cuda")
    pos = position[ids]
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=g), dim=-1)
    if fmt == "bf16":
        w13 = (torch.randn(12, 2 * inter, hidden, device="cuda", generator=g) * hidden**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(12, hidden, inter, device="cuda", generator=g) * inter**-0.5).to(torch.bfloat16)
    else:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "kernels"))
        from quantized_slots import make_experts

        w13, w2 = make_experts(fmt, hidden, inter, 12, torch.Generator().manual_seed(tokens), device="cuda")
    block_m = block_m_for(pos.numel())
    return x, pos, weights, w13, w2, (align_pairs_by_slot(pos, staged, block_m, staged, block_starts=True), block_m)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "mxfp4", "fp8-block"])
@pytest.mark.parametrize("tokens,skewed", [(8192, False), (1250, False), (2048, True)])
def test_a_window_launched_over_its_own_blocks_gives_the_full_grids_bits(fmt, tokens, skewed):
    """The streamed prefill's chunks (device_store._stream_staged): launched over their own blocks from the
    aligned block starts, looping where a window has more blocks than programs, the rows are bit for bit
    those of the launch over every block of the layer (the same tiles, the same order within each)."""
    from ferry.kernels.aligned_blocks import launch_blocks
    from ferry.kernels.grouped_expert_gemm import grouped_expert_rows_triton

    g = torch.Generator(device="cuda").manual_seed(tokens + skewed)
    staged = 230 if tokens == 8192 else 176  # the 35B at 131k context; issue 23's warm step on the 8-layer cut
    x, pos, weights, w13, w2, (aligned, block_m) = _staged_layer(fmt, tokens, 256, staged, 8, skewed, g)
    got = torch.full((tokens, 8, 2048), float("nan"), device="cuda")
    want = torch.full_like(got, float("nan"))
    looped = 0
    for lo in range(0, staged, 12):
        hi = min(lo + 12, staged)
        # the bay holds the window's experts: slot (position - lo); a fresh draw per window is not needed
        grouped_expert_rows_triton(x, None, weights, w13, w2, got, aligned=aligned, slot_window=(lo, hi, -lo))
        grouped_expert_rows_triton(x, None, weights, w13, w2, want, aligned=aligned[:2], slot_window=(lo, hi, -lo))
        starts = aligned[2]
        programs = launch_blocks(aligned, pos.numel(), block_m, (lo, hi, -lo))[3]
        looped += int(starts[hi] - starts[lo]) > programs
    routed = pos >= 0
    assert not torch.isnan(got[routed]).any() and torch.isnan(got[~routed]).all()
    assert torch.equal(got[routed], want[routed])
    if skewed:
        assert looped, "the skewed layer's first window should have more blocks than programs"


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "mxfp4", "fp8-block"])
def test_a_long_steps_rows_in_bf16_are_its_float32_rows_rounded_once(fmt):
    """A step past ROWS_FLOAT32_MAX_TOKENS (8,192; here 16,384 tokens, the plan's long chunk) writes its rows in
    bf16 (kernels/expert_rows_sum.py): each pair's float32 row rounded to nearest even, once, in every window
    of the ring, skipped pairs untouched. The sum over k in float32, rounded to bf16, is then within one bf16
    rounding of each row and one of the sum: 2^-8 x (the rows' absolute values + the sum's), with 1 % for
    the float32 adds. (A bound relative to the sum alone is wrong: rows of opposite signs cancel; on the H200
    67-209 of 33.5M sums missed such a bound, by up to 0.0057.)"""
    from ferry.kernels.expert_rows_sum import new_rows, rows_dtype, sum_rows
    from ferry.kernels.grouped_expert_gemm import grouped_expert_rows_triton

    tokens = 16384
    g = torch.Generator(device="cuda").manual_seed(7)
    x, pos, weights, w13, w2, (aligned, _) = _staged_layer(fmt, tokens, 256, 200, 8, False, g)
    assert rows_dtype(tokens, x.dtype) == torch.bfloat16 and rows_dtype(8192, x.dtype) == torch.float32
    wide = torch.full((tokens, 8, 2048), float("nan"), device="cuda")
    narrow = new_rows(x, 8)
    narrow.fill_(float("nan"))
    assert narrow.dtype == torch.bfloat16
    for lo in range(0, 200, 12):
        window = (lo, min(lo + 12, 200), -lo)
        grouped_expert_rows_triton(x, None, weights, w13, w2, wide, aligned=aligned, slot_window=window)
        grouped_expert_rows_triton(x, None, weights, w13, w2, narrow, aligned=aligned, slot_window=window)
    routed = pos >= 0
    assert torch.isnan(narrow[~routed].float()).all() and not torch.isnan(narrow[routed].float()).any()
    assert torch.equal(narrow[routed], wide[routed].to(torch.bfloat16))
    wide[~routed], narrow[~routed] = 0.0, 0.0
    exact = wide.sum(dim=1)
    got = sum_rows(narrow, torch.bfloat16).float()
    bound = 2**-8 * (wide.abs().sum(dim=1) + got.abs()) * 1.01
    worst = ((got - exact).abs() / bound.clamp_min(1e-30)).max().item()
    assert worst <= 1.0, f"a sum {worst:.3f} of its bound away"
