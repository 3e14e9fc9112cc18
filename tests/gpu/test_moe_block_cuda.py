"""The fused MoE block on a real GPU at the published models' shapes (skipped without CUDA).

Qwen3.6-35B-A3B (hidden 2048, 256 experts, top 8, renormalised, shared expert 512),
Qwen3-30B-A3B (128 experts, top 8, no shared expert) and GLM-4.5-Air (hidden 4096, 128 experts, top 8, the
sigmoid router with its score bias, an ungated shared expert), one MoE layer each, bf16, all resident:
* the router kernel against its twin on the same fused logits (same experts in the same order,
  weights and the shared gate's sigmoid within one bf16 rounding), both norm_topk_prob variants,
  ties, and token counts from one decode row to a prefill chunk, with one compiled variant;
* SiLU-and-mul and the combine against torch's ops (the combine bit for bit: no transcendental);
* the marking kernel against the scatter;
* the whole block, fused path against its plain-torch reference, and replayed as a CUDA graph;
* its routed rows left unsummed for the next norm, against summing them first, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ferry.kernels.expert_rows_sum import ExpertRows, sum_rows_triton
from ferry.kernels.moe_combine import moe_combine_reference, moe_combine_triton, silu_mul_reference, silu_mul_triton
from ferry.kernels.router_topk import SigmoidRouting, _router_topk_kernel, mark_routed_triton, router_topk_triton
from ferry.kernels.router_topk_reference import mark_routed_reference, router_topk_reference, sigmoid_topk_reference
from ferry.plan import pool_layout as L
from ferry.plan.model_config import parse_model_config
from ferry.services.worker.layers.mlp import SparseMoeBlock
from ferry.services.worker.layers.norms import make_norm
from ferry.services.worker.offload.stores.resident import ResidentExperts
from ferry.services.worker.pools import ExpertSlotPool, allocate_pool
from tests.helpers import GLM_4_5_AIR, QWEN3_6_35B, QWEN3_30B

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOKENS = (1, 3, 8, 17, 64, 512, 4096)  # decode rows to a prefill chunk
BF16_ULP = 2**-7  # bf16 keeps 8 significant bits: one ulp is 2^-8 to 2^-7 of the value


def _one_layer_spec(model_dir: Path):
    raw = json.loads((model_dir / "config.json").read_text())
    text = raw.get("text_config", raw)
    text.update(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[], first_k_dense_replace=0)
    return parse_model_config(raw)


SPECS = {
    "qwen3.6-35b-a3b": lambda: _one_layer_spec(QWEN3_6_35B),
    "qwen3-30b-a3b": lambda: _one_layer_spec(QWEN3_30B),
    "glm-4.5-air": lambda: _one_layer_spec(GLM_4_5_AIR),
}


@pytest.fixture(scope="module", params=list(SPECS))
def block(request):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec = SPECS[request.param]()
    device = torch.device("cuda")
    slots = ExpertSlotPool(allocate_pool(L.expert_slot_layout(spec, "bfloat16", spec.num_experts), device))
    store = ResidentExperts(slots, 1, spec.num_experts)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        slots.w13.normal_(0, 0.02, generator=g)
        slots.w2.normal_(0, 0.02, generator=g)
        moe = SparseMoeBlock(spec, 0, store, torch.bfloat16, device)
        for name, p in moe.named_parameters():
            p.normal_(0, 0.02 if "down" not in name else 0.002, generator=g)
    return spec, moe, store


def _x(t: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(t, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("norm", [True, False])
def test_router_kernel_matches_its_twin_on_the_fused_logits(block, norm):
    spec, moe, _ = block
    for t in TOKENS:
        logits = F.linear(_x(t, spec.hidden_size, t), moe.gate.logit_weight)
        ids, w, shared = router_topk_triton(logits, spec.num_experts_per_tok, norm, spec.num_experts)
        want_ids, want_w, want_shared = router_topk_reference(logits, spec.num_experts_per_tok, norm, spec.num_experts)
        assert torch.equal(ids, want_ids), f"T={t}"
        torch.testing.assert_close(w.float(), want_w.float(), rtol=BF16_ULP, atol=1e-3)
        if want_shared is not None:
            torch.testing.assert_close(shared.float(), want_shared.float(), rtol=BF16_ULP, atol=1e-3)
        else:
            assert shared is None


@pytest.mark.parametrize("groups,topk_groups", [(1, 1), (8, 4)])
def test_sigmoid_router_kernel_matches_its_twin_on_float32_logits(block, groups, topk_groups):
    """The sigmoid router as TopKRouter's Triton path runs it (float32 logits), with the block's score bias,
    and with DeepSeek-V3-style groups on the same logits."""
    spec, moe, _ = block
    if spec.router_scoring != "sigmoid":
        pytest.skip("a softmax router")
    bias = moe.gate.e_score_correction_bias
    routing = SigmoidRouting(bias, groups, topk_groups, 2.5, torch.bfloat16)
    for t in TOKENS:
        logits = F.linear(_x(t, spec.hidden_size, t).float(), moe.gate.weight.float())
        ids, w, shared = router_topk_triton(logits, spec.num_experts_per_tok, True, spec.num_experts, None, routing)
        want_ids, want_w = sigmoid_topk_reference(
            logits, spec.num_experts_per_tok, True, bias, groups, topk_groups, 2.5, torch.bfloat16
        )
        assert shared is None and torch.equal(ids, want_ids), f"T={t}"
        torch.testing.assert_close(w.float(), want_w.float(), rtol=BF16_ULP, atol=1e-3)


@pytest.mark.parametrize("norm", [True, False])
def test_router_ties_go_to_the_lower_expert_id_on_cuda(norm):
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randint(0, 4, (257, 257), device="cuda", generator=g).float() * 0.25).bfloat16()
    ids, _, _ = router_topk_triton(logits, 8, norm, 256)
    assert torch.equal(ids, router_topk_reference(logits, 8, norm, 256)[0])


def test_router_kernel_compiles_once_whatever_the_token_count(block):
    spec, moe, _ = block
    router_topk_triton(
        F.linear(_x(1, spec.hidden_size, 0), moe.gate.logit_weight),
        spec.num_experts_per_tok,
        spec.norm_topk_prob,
        spec.num_experts,
    )
    cache = _router_topk_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    for t in TOKENS + (16, 32, 1000):
        router_topk_triton(
            F.linear(_x(t, spec.hidden_size, t), moe.gate.logit_weight),
            spec.num_experts_per_tok,
            spec.norm_topk_prob,
            spec.num_experts,
        )
    assert len(cache) == before, "a new token count compiled a new variant"


def test_silu_mul_and_combine_stay_within_an_ulp_of_torch():
    g = torch.Generator(device="cuda").manual_seed(2)
    for t in TOKENS:
        gate_up = (torch.randn(t, 1024, device="cuda", generator=g) * 3).bfloat16()
        got, want = silu_mul_triton(gate_up), silu_mul_reference(gate_up)
        # Triton's exp and division are approximate, CUDA's expf and division are not: the silu may
        # round one ulp apart near a rounding boundary, and its product then by up to two
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * BF16_ULP, atol=1e-3)
        assert (got != want).float().mean() < 0.05, f"T={t}: {float((got != want).float().mean()):.2%} differ"
        routed, shared = (torch.randn(t, 2048, device="cuda", generator=g).bfloat16() for _ in range(2))
        gate = torch.rand(t, 1, device="cuda", generator=g).bfloat16()
        # torch rounds the product and then the sum; the compiled kernel keeps only the sum's rounding
        # (on the H200, a3cc1af: 13.5% of the elements an ulp apart at T=1, all within this bound). A
        # difference in the product's rounding stays an ulp of the product after the sum, however small
        # the sum (the two may cancel): so the bound is an ulp of the operands, not of the result; and the
        # kernel must be nearer the exact sum than that
        got, want = moe_combine_triton(routed, gate, shared), moe_combine_reference(routed, gate, shared)
        operands = routed.float().abs() + (gate.float() * shared.float()).abs()
        err = (got.float() - want.float()).abs()
        assert (err <= BF16_ULP * operands + 1e-6).all(), f"T={t}: {float((err / operands).max())} of an operand"
        exact = routed.double() + gate.double() * shared.double()
        assert ((got.double() - exact).abs() <= BF16_ULP * operands.double() + 1e-6).all()


def test_the_combine_summing_rows_gives_the_bits_of_summing_them_first():
    """The shared-expert block's combine sums the routed rows itself (kernels/expert_rows_sum.py): its
    rounding of that sum must be sum_rows', whatever the compiled kernel does to the product's."""
    g = torch.Generator(device="cuda").manual_seed(6)
    for t in (1, 3, 8, 17):
        rows = torch.randn(t, 8, 2048, device="cuda", generator=g) * 0.05
        gate = torch.rand(t, 1, device="cuda", generator=g).bfloat16()
        for shared in (
            torch.randn(t, 2048, device="cuda", generator=g).bfloat16(),
            torch.randn(t, 2048, device="cuda", generator=g).bfloat16().float(),
        ):
            got = moe_combine_triton(ExpertRows(rows, torch.bfloat16), gate, shared)
            want = moe_combine_triton(sum_rows_triton(rows, torch.bfloat16), gate, shared)
            assert torch.equal(got, want), f"T={t}, shared {shared.dtype}"


def test_marking_kernel_matches_the_scatter():
    g = torch.Generator(device="cuda").manual_seed(3)
    for t, n in ((1, 1), (8, 5), (4096, 4000)):
        ids = torch.rand(t, 256, device="cuda", generator=g).topk(8, dim=-1).indices
        n_rows = torch.tensor([n], dtype=torch.int32, device="cuda")
        got = torch.zeros(40, 256, dtype=torch.int32, device="cuda")
        want = got.clone()
        mark_routed_triton(got, 39, ids, n_rows)
        mark_routed_reference(want, 39, ids, n_rows)
        assert torch.equal(got, want)


def _ctx(n: int):
    return SimpleNamespace(batch=SimpleNamespace(real_tokens=torch.tensor([n], dtype=torch.int32, device="cuda")))


@torch.inference_mode()
def test_fused_block_matches_its_reference(block):
    """The fused router's logits come from one [E + 1, hidden] GEMM instead of two, whose bf16
    roundings may differ by an ulp and flip a near-tied expert: rows routed alike must agree to bf16
    rounding, and almost every row must be routed alike."""
    spec, moe, _ = block
    for t in TOKENS:
        x = _x(t, spec.hidden_size, 100 + t)
        ids, _, _ = moe.gate(x)
        ref_ids, _, _ = moe.gate.reference(x)
        same = (ids.sort(dim=-1).values == ref_ids.sort(dim=-1).values).all(dim=-1)
        assert same.float().mean() >= 0.9, f"T={t}: {same.float().mean():.2%} of rows routed alike"
        got, want = moe(x, _ctx(t)), moe.reference(x, _ctx(t))
        assert torch.isfinite(got).all()
        # a few bf16 roundings apart (the GEMMs' sums differ, so do the roundings after them); near
        # zero a cancelling sum keeps an ulp of its larger operand: an absolute floor at the output's scale
        scale = want.float().abs().mean().item()
        err = (got.float() - want.float()).abs()[same]
        # bf16 roundings apart: on the H200, 19 of 8.2 million elements (T=4096) were past 2**-6 relative
        # and 0.05 x scale, by at most 1.5x; a wrong expert or weight would move most of a row
        beyond = err > 2**-6 * want.float().abs()[same] + 0.05 * scale
        assert beyond.float().mean() <= 1e-5, f"T={t}: {int(beyond.sum())} elements past bf16 rounding"
        assert err.max() <= 4 * (2**-6 * want.float().abs().max().item() + 0.05 * scale)
        assert err.mean() <= 0.02 * scale, f"T={t}: mean error {err.mean()} at scale {scale}"


@torch.inference_mode()
def test_unsummed_rows_through_the_next_norm_are_the_summed_outputs_bits(block):
    """The decoder asks the block for its routed rows unsummed; the next RMSNorm (with the residual
    add) or the shared expert's combine sums them: the same bits as summing first, at decode sizes,
    eagerly and replayed in a CUDA graph (kernels/expert_rows_sum.py)."""
    spec, moe, _ = block
    norm = make_norm(spec.zero_centered_norms, spec.hidden_size, spec.rms_norm_eps, torch.bfloat16, "cuda")
    norm.weight.normal_(0, 0.3, generator=torch.Generator(device="cuda").manual_seed(9))
    for t in (1, 3, 8):
        x, residual = _x(t, spec.hidden_size, 40 + t), _x(t, spec.hidden_size, 50 + t)
        rows = moe(x, _ctx(t), summed=False)
        assert isinstance(rows, ExpertRows) == (moe.shared_expert is None), type(rows)
        got, want = norm.forward_add(rows, residual), norm.forward_add(moe(x, _ctx(t)), residual)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), f"T={t}"
    ctx, graph = _ctx(t), torch.cuda.CUDAGraph()  # the context's device tensor made before the capture
    with torch.cuda.graph(graph):
        out, _ = norm.forward_add(moe(x, ctx, summed=False), residual)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want[0])


@torch.inference_mode()
def test_fused_block_replays_as_a_cuda_graph(block):
    """Graph-safe: no host synchronisation, fixed addresses; padding rows (past real_tokens) are
    not marked in the resident store's table."""
    spec, moe, store = block
    t, real = 8, 5
    x = _x(t, spec.hidden_size, 7)
    ctx = _ctx(real)
    eager = moe(x, ctx).clone()
    torch.cuda.synchronize()
    store._routed.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x, ctx)
    store._routed.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    ids = moe.gate(x)[0]
    want = torch.zeros_like(store._routed)
    mark_routed_reference(want, 0, ids, ctx.batch.real_tokens)
    assert torch.equal(store._routed, want)
    x.copy_(_x(t, spec.hidden_size, 8))  # new inputs in the same buffer: the replay follows them
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe(x, ctx))
    store._routed.zero_()
