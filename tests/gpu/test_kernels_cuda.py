"""Kernel twins on CUDA: the compiled Triton paged attention and fla's gated delta rule against
the float32 references (skipped without a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_kernel_paged_attention import CASES, _scenario  # noqa: E402

from ferry.kernels.gated_delta_rule import gated_delta_rule_varlen  # noqa: E402
from ferry.kernels.gated_delta_rule_reference import gated_delta_rule_chunked, gated_delta_rule_recurrent  # noqa: E402
from ferry.kernels.paged_attention_reference import paged_attention_reference  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# kernel -> (scenario seed, tolerance for float32, for bfloat16). Decode: both accumulate in fp32, orders
# differ; bf16 is one final rounding of the same value (2^-8). Prefill: fp32 dots run as tf32 on tensor
# cores (10-bit mantissa, ~1e-3); bf16 probabilities are rounded before the second dot, on top of that.
PAGED_KERNELS = {"decode": (1, 1e-4, 1e-2), "prefill": (2, 2e-3, 2e-2)}
# the served models' own attention shapes, with the prefill's real tiles (prefill_tiles) over thousands of
# keys: Qwen3.5/3.6's gated attention (16 heads, 2 kv heads, 256) and Qwen3-30B-A3B's (32, 4, 128)
SERVED_CASES = [(16, 16, 2, 256, [300, 1, 40], [2000, 700, 0]), (16, 32, 4, 128, [129, 64], [1500, 3])]


@pytest.mark.parametrize("case", CASES + SERVED_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", list(PAGED_KERNELS))
def test_triton_paged_attention_on_cuda(case, dtype, kernel):
    from ferry.kernels import paged_attention_triton as kernels

    seed, tol32, tol16 = PAGED_KERNELS[kernel]
    page_size, heads, kv_heads, head_dim, qlens, clens = case
    q, kc, vc, pt, qs, pos, _, _ = _scenario(seed, page_size, heads, kv_heads, head_dim, qlens, clens, dtype)
    expected = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5)
    cuda = [t.cuda() for t in (q, kc, vc, pt, qs, pos)]
    out = torch.full_like(cuda[0], float("nan"))
    if kernel == "decode":
        kernels.paged_attention_decode_triton(*cuda, head_dim**-0.5, out=out)
    else:
        kernels.paged_attention_prefill_triton(*cuda, qlens, head_dim**-0.5, out=out)
    assert torch.isfinite(out).all()
    tol = tol32 if dtype == torch.float32 else tol16
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=tol, atol=tol)


# requests of 128 new tokens or more take FlashAttention in bf16 (kernels/paged_attention_flash.py), the rest
# the paged Triton kernel; float32 takes the paged kernel alone
DISPATCH_CASES = [
    (16, 16, 2, 256, [300, 1, 40], [2000, 700, 0]),
    (16, 16, 2, 256, [1, 700, 128], [30, 5000, 0]),
    (16, 32, 4, 128, [129, 64], [1500, 3]),
    (16, 16, 2, 256, [4096], [0]),
]


@pytest.mark.parametrize("buffered", [False, True], ids=["fresh", "pool-buffers"])
@pytest.mark.parametrize("case", DISPATCH_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_dispatch_on_cuda(case, dtype, buffered, monkeypatch):
    from ferry.kernels import paged_attention as dispatch

    page_size, heads, kv_heads, head_dim, qlens, clens = case
    q, kc, vc, pt, qs, pos, _, _ = _scenario(4, page_size, heads, kv_heads, head_dim, qlens, clens, dtype)
    expected = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5)
    flashed = []
    real = dispatch.flash_prefill_into
    # (first row, whether FlashAttention took it): a refusal falls back to the paged kernel, whose output
    # would pass the comparison below all the same
    monkeypatch.setattr(
        dispatch,
        "flash_prefill_into",
        lambda *a, **scales: flashed.append((a[5], real(*a, **scales))) or flashed[-1][1],
    )
    cuda = [t.cuda() for t in (q, kc, vc, pt, qs, pos)]
    gather = None
    if buffered:  # as KvTensorPool.gather_buffers gives them: whole pages, poisoned
        pages = max(-(-(q_ + c) // page_size) for q_, c in zip(qlens, clens))
        buffers = tuple(torch.full((pages, *kc.shape[1:]), float("nan"), dtype=dtype, device="cuda") for _ in "kv")
        gather = lambda: buffers  # noqa: E731
    out = dispatch.paged_attention(*cuda, qlens, clens, head_dim**-0.5, gather=gather)
    assert torch.isfinite(out).all()
    long_rows = [sum(qlens[:r]) for r, n in enumerate(qlens) if n >= 128]
    assert flashed == ([(row, True) for row in long_rows] if dtype == torch.bfloat16 else [])
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [70, 1, 5], [17], [130, 64, 1, 65]])
def test_fla_gated_delta_rule_matches_reference(query_lens):
    pytest.importorskip("fla")
    g = torch.Generator().manual_seed(0)
    total, k_heads, v_heads, dk, dv = sum(query_lens), 2, 4, 32, 32
    q = torch.randn(total, k_heads, dk, generator=g).bfloat16()
    k = torch.randn(total, k_heads, dk, generator=g).bfloat16()
    v = torch.randn(total, v_heads, dv, generator=g).bfloat16()
    decay = -torch.rand(total, v_heads, generator=g) * 2
    beta = torch.rand(total, v_heads, generator=g).bfloat16()
    states = torch.randn(6, v_heads, dk, dv, generator=g) * 0.1
    slots = torch.tensor([5, 2, 3, 1][: len(query_lens)])  # a slot a request (states has 6)
    qs = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qs[1:] = torch.tensor(query_lens).cumsum(0)
    expected_states = states.clone()
    expected, start = [], 0
    for slot, n in zip(slots.tolist(), query_lens):
        rule = gated_delta_rule_recurrent if n == 1 else gated_delta_rule_chunked
        rows = slice(start, start + n)
        o, expected_states[slot] = rule(q[rows], k[rows], v[rows], decay[rows], beta[rows], states[slot])
        expected.append(o)
        start += n
    cuda_states = states.cuda()
    out = gated_delta_rule_varlen(
        q.cuda(), k.cuda(), v.cuda(), decay.cuda(), beta.cuda(), cuda_states, slots.cuda(), qs.cuda(), query_lens
    )
    # bf16 output rounding (2^-8 relative) on O(1) values; fla's tensor-core dots add about as much
    torch.testing.assert_close(out.cpu().float(), torch.cat(expected), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cuda_states.cpu(), expected_states, rtol=2e-2, atol=2e-2)


def test_fla_chunk_list_is_fla_own_and_a_prefill_rule_never_waits_for_the_device():
    """kernels/gated_delta_rule.chunk_indices gives fla's own chunk list, and with it a prefill step's
    rule (after a first call that compiles and tunes fla's kernels) makes no host synchronisation, nor
    does the rule that keeps states inside rows."""
    pytest.importorskip("fla")
    import itertools

    from fla.ops.utils.index import prepare_chunk_indices

    from ferry.kernels.gated_delta_rule import chunk_indices, gated_delta_rule_varlen_keeping

    for lens in ([1, 64, 65, 130, 0, 3], [8192], [300, 1, 40]):
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long, device="cuda")
        assert torch.equal(chunk_indices(lens, torch.device("cuda")), prepare_chunk_indices(cu, 64))
    g = torch.Generator(device="cuda").manual_seed(1)
    lens, k_heads, v_heads, dim = [300, 1, 40], 2, 4, 64
    t = sum(lens)
    args = (
        torch.randn(t, k_heads, dim, device="cuda", generator=g).bfloat16(),
        torch.randn(t, k_heads, dim, device="cuda", generator=g).bfloat16(),
        torch.randn(t, v_heads, dim, device="cuda", generator=g).bfloat16(),
        -torch.rand(t, v_heads, device="cuda", generator=g),
        torch.rand(t, v_heads, device="cuda", generator=g).bfloat16(),
        torch.zeros(5, v_heads, dim, dim, device="cuda"),
        torch.tensor([3, 1, 4], device="cuda"),
        torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda"),
        lens,
    )
    gated_delta_rule_varlen(*args)
    # keeping states inside rows (a prefix-cache step's snapshots): the same, its index arrays sent pinned
    inside, host_slots = [(0, 130), (2, 17)], [3, 1, 4]
    gated_delta_rule_varlen_keeping(*args, inside, host_slots)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gated_delta_rule_varlen(*args)
        gated_delta_rule_varlen_keeping(*args, inside, host_slots)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# the served models' projections (N, K): Qwen3-30B's fused q/k/v and o_proj, a router with the shared
# expert's gate row, a Gated DeltaNet in_proj, and shapes no tile divides
DENSE_SHAPES = [(5120, 2048), (2048, 4096), (257, 2048), (12352, 2048), (129, 200), (1, 64)]


@pytest.mark.parametrize("shape", DENSE_SHAPES, ids=[f"{n}x{k}" for n, k in DENSE_SHAPES])
@pytest.mark.parametrize("tokens", [1, 3, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_gemv_matches_linear_on_cuda(shape, tokens, dtype):
    """The decode projections' GEMV (compiled, tensor-core dots past one token) against F.linear in float32;
    inside a CUDA graph too, where a decode step runs it."""
    import torch.nn.functional as F

    from ferry.kernels.dense_gemv import dense_gemv_triton, dense_linear

    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(n + tokens)
    weight = (torch.randn(n + 3, k, device="cuda", generator=g) * 0.05).to(dtype)[1 : 1 + n]  # a row view
    bias = torch.randn(n, device="cuda", generator=g).to(dtype)
    x = torch.randn(tokens, k, device="cuda", generator=g).to(dtype)
    want = F.linear(x.double(), weight.double(), bias.double())
    tol = 1e-4 if dtype == torch.float32 else 2**-7  # the sum's order; bf16: one rounding of the output
    got = dense_gemv_triton(x, weight, bias)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    out = torch.empty_like(got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(dense_linear(x, weight, bias))
    x.copy_(torch.randn(tokens, k, device="cuda", generator=g).to(dtype))
    graph.replay()
    want = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
def test_the_hand_off_stages_to_and_folds_from_pinned_memory_as_its_twins(rows_dtype):
    """kernels/host_share_rows.py on CUDA: the GPU writes the pair block and input rows into pinned buffers
    and reads the host's sum from one, through their mapped addresses, bit for bit as the torch twins."""
    from ferry.kernels.host_share_rows import fold_host_sum, fold_host_sum_reference, stage_for_host

    g = torch.Generator().manual_seed(5)
    # past one pass of the grid (8 programs x 1,024 words): the block's 10,000 words, the rows' 10,240
    block = torch.randint(0, 256, (40000,), generator=g, dtype=torch.int32).to(torch.uint8).cuda()
    x = torch.randn(5, 4096, generator=g).to(torch.bfloat16).cuda()
    block_host = torch.zeros(40000, dtype=torch.uint8, pin_memory=True)
    x_host = torch.full((8, 4096), 7.0, dtype=torch.bfloat16, pin_memory=True)
    stage_for_host(block, block_host, x, x_host)
    torch.cuda.synchronize()
    assert torch.equal(block_host, block.cpu()) and torch.equal(x_host[:5], x.cpu()) and (x_host[5:] == 7.0).all()
    rows = torch.randn(3, 8, 2048, generator=g).to(rows_dtype).cuda()
    flags = (torch.rand(24, generator=g) < 0.4).to(torch.int8)
    flags[0] = 1
    host_sum = torch.randn(8, 2048, generator=g).pin_memory()
    want = fold_host_sum_reference(rows.clone(), flags.cuda(), host_sum.cuda())
    fold_host_sum(rows, flags.cuda(), host_sum)
    torch.cuda.synchronize()
    assert torch.equal(rows, want)
