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
