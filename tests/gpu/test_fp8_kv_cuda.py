"""--kv-cache-dtype fp8 on CUDA (skipped without a GPU): the compiled Triton kernels that write and read an fp8
KV pool (the fused K/V write, paged decode and prefill, FlashAttention's dequantizing gather) against their
torch twins, the dispatch with FlashAttention on fp8 pages, and the fp8 pool's bytes as priced."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_kernel_paged_attention import CASES, _scenario  # noqa: E402
from test_kernel_qk_norm_rope import CASES as ROPE_CASES  # noqa: E402
from test_kernel_qk_norm_rope import _case as rope_case

from ferry.kernels.paged_attention_reference import gather_request_kv, paged_attention_reference, write_kv  # noqa: E402
from ferry.kernels.qk_norm_rope import qk_norm_rope_kv_triton  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# the served models' attention shapes over thousands of keys (as tests/gpu/test_kernels_cuda.py's)
SERVED_CASES = [(16, 16, 2, 256, [300, 1, 40], [2000, 700, 0]), (16, 32, 4, 128, [129, 64], [1500, 3])]
# the twin dequantizes in float32 and attends in float32; the kernels dot e4m3 values as bf16 (exact) and scale
# the float32 scores, and the probabilities x the value scales are rounded to bf16 before the second dot, as
# the model dtype's kernel rounds its probabilities: the bf16 tolerances of test_kernels_cuda.py
PAGED_TOLERANCE = {"decode": 1e-2, "prefill": 2e-2}


@pytest.mark.parametrize("case", CASES + SERVED_CASES)
@pytest.mark.parametrize(
    "dtype,value_size",
    [(torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float16, 1.0), (torch.bfloat16, 1e-3), (torch.float16, 1e-3)],
)
@pytest.mark.parametrize("kernel", list(PAGED_TOLERANCE))
def test_triton_paged_attention_on_an_fp8_pool(case, dtype, value_size, kernel):
    """value_size 1e-3: value rows a thousandth of the usual size (their scales scaled down), whose
    probability x scale products fp16 holds only because the kernels lift them (V_SCALE_LIFT)."""
    from ferry.kernels import paged_attention_triton as kernels

    page_size, heads, kv_heads, head_dim, qlens, clens = case
    q, kc, vc, pt, qs, pos, _, _, (ks, vs) = _scenario(
        7, page_size, heads, kv_heads, head_dim, qlens, clens, dtype, "fp8"
    )
    vs = vs * value_size
    expected = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5, ks, vs)
    cuda = [t.cuda() for t in (q, kc, vc, pt, qs, pos)]
    scales = dict(k_scale=ks.cuda(), v_scale=vs.cuda())
    out = torch.full_like(cuda[0], float("nan"))
    if kernel == "decode":
        kernels.paged_attention_decode_triton(*cuda, head_dim**-0.5, out=out, **scales)
    else:
        kernels.paged_attention_prefill_triton(*cuda, qlens, head_dim**-0.5, out=out, **scales)
    assert torch.isfinite(out).all()
    tol = PAGED_TOLERANCE[kernel]
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=tol, atol=tol * value_size)


DISPATCH_CASES = [
    (16, 16, 2, 256, [300, 1, 40], [2000, 700, 0]),
    (16, 16, 2, 256, [1, 700, 128], [30, 5000, 0]),
    (16, 32, 4, 128, [129, 64], [1500, 3]),
]


@pytest.mark.parametrize("buffered", [False, True], ids=["fresh", "pool-buffers"])
@pytest.mark.parametrize("case", DISPATCH_CASES)
def test_dispatch_on_an_fp8_pool_takes_flash_for_long_queries(case, buffered, monkeypatch):
    """bf16 queries on e4m3 pages: long requests through FlashAttention on K/V that the gather kernel
    dequantized into the pool's bf16 buffers (or fresh ones), the rest through the paged kernel."""
    from ferry.kernels import paged_attention as dispatch

    page_size, heads, kv_heads, head_dim, qlens, clens = case
    q, kc, vc, pt, qs, pos, _, _, (ks, vs) = _scenario(
        4, page_size, heads, kv_heads, head_dim, qlens, clens, torch.bfloat16, "fp8"
    )
    expected = paged_attention_reference(q, kc, vc, pt, qlens, clens, head_dim**-0.5, ks, vs)
    flashed = []
    real = dispatch.flash_prefill_into
    monkeypatch.setattr(
        dispatch,
        "flash_prefill_into",
        lambda *a, **scales: flashed.append((a[5], real(*a, **scales))) or flashed[-1][1],
    )
    cuda = [t.cuda() for t in (q, kc, vc, pt, qs, pos)]
    gather = None
    if buffered:  # as KvTensorPool.gather_buffers gives them for an fp8 pool: whole pages of the model dtype
        pages = max(-(-(q_ + c) // page_size) for q_, c in zip(qlens, clens))
        buffers = tuple(
            torch.full((pages, *kc.shape[1:]), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in "kv"
        )
        gather = lambda: buffers  # noqa: E731
    out = dispatch.paged_attention(
        *cuda, qlens, clens, head_dim**-0.5, gather=gather, k_scale=ks.cuda(), v_scale=vs.cuda()
    )
    assert torch.isfinite(out).all()
    long_rows = [sum(qlens[:r]) for r, n in enumerate(qlens) if n >= 128]
    assert flashed == [(row, True) for row in long_rows]
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_gather_kernel_is_its_twin_on_cuda(dtype):
    """On the GPU the bf16 cast rounds to nearest even, as torch's: the same bytes at both dtypes."""
    from ferry.kernels.kv_gather_triton import gather_dequantize_kv_triton

    _, kc, _, pt, *_, (ks, _) = _scenario(2, 16, 4, 2, 256, [3000], [0], kv_cache_dtype="fp8")
    want = gather_request_kv(kc, pt[0], 3000, scales=ks, dtype=dtype)
    into = torch.full((200, 16, 2, 256), float("nan"), dtype=dtype, device="cuda")
    got = gather_dequantize_kv_triton(kc.cuda(), ks.cuda(), pt[0].cuda(), 3000, dtype, into)
    assert got.data_ptr() == into.data_ptr() and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("index", range(len(ROPE_CASES)))
def test_qk_norm_rope_kv_quantizes_as_its_twin_on_cuda(index):
    """V rows take the twin's exact bytes and scales (div_rn, the e4m3 grid, a cast that rounds nothing); K rows
    agree within the model dtype's rounding of the normed, rotated values and one e4m3 step."""
    case = ROPE_CASES[index]
    rotary, q_norm, k_norm, q, k, v, cos, sin, slots, cache = rope_case(index, *case)
    rotary, q_norm, k_norm = rotary.cuda(), q_norm.cuda(), k_norm.cuda()
    q, k, v, cos, sin, slots = (t.cuda() for t in (q, k, v, cos, sin, slots))
    fp8 = torch.full(cache.shape, float("nan"), dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.full(cache.shape[:-1], float("nan"), device="cuda")
    want = (fp8.clone(), fp8.clone(), scale.clone(), scale.clone())
    write_kv(want[0], want[1], slots, rotary.apply(k_norm.reference(k), cos, sin), v, want[2], want[3])
    got = (fp8.clone(), fp8.clone(), scale.clone(), scale.clone())
    qk_norm_rope_kv_triton(
        q,
        k,
        v,
        q_norm.weight,
        k_norm.weight,
        1e-6,
        case[5],
        cos,
        sin,
        rotary.rotary_dim,
        slots,
        got[0],
        got[1],
        k_scale=got[2],
        v_scale=got[3],
    )
    written = ~torch.isnan(want[2])
    assert torch.equal(~torch.isnan(got[2]), written) and torch.equal(~torch.isnan(got[3]), written)
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(got[3][written], want[3][written])
    k_got = got[0].float()[written] * got[2][written][:, None]
    k_want = want[0].float()[written] * want[2][written][:, None]
    amax = k_want.abs().amax(-1, keepdim=True)
    assert ((k_got - k_want).abs() <= k_want.abs() * 2**-3 + amax * 3e-2).all()


def test_fp8_pool_takes_exactly_the_priced_bytes_on_cuda(cuda_device):
    from ferry.plan.model_config import load_model_config
    from ferry.plan.planner import Measured, PlanRequest, make_plan
    from ferry.services.worker.pools import allocate_pools
    from tests.helpers import QWEN3_6_35B

    spec = load_model_config(QWEN3_6_35B)
    plan = make_plan(
        spec,
        PlanRequest(
            gpu_memory=8 * 2**30, max_model_len=8192, max_running_requests=8, moe_cache_size=300, kv_cache_dtype="fp8"
        ),
        Measured(0, 0),
    )
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    pools = allocate_pools(spec, plan, cuda_device)
    torch.cuda.synchronize()
    priced = plan.kv.bytes + plan.linear_state.bytes + plan.linear_state_snapshots.bytes + plan.experts.bytes
    assert torch.cuda.memory_allocated() - before == priced
    assert pools.kv.kv.dtype == torch.float8_e4m3fn and pools.kv.scale.dtype == torch.float32
    k_buffer, v_buffer = pools.kv.gather_buffers()  # FlashAttention's buffers: the model dtype, as priced
    assert k_buffer.dtype == v_buffer.dtype == torch.bfloat16
    del pools, k_buffer, v_buffer
