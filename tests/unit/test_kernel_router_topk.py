"""The MoE router kernel and the routed-marking kernel (kernels/router_topk.py) against their twins
(kernels/router_topk_reference.py) under the Triton interpreter, in a child process
(interpreted_triton.py). Fresh random inputs, outputs poisoned."""

import pytest
import torch
from interpreted_triton import run_interpreted

from ferry.kernels.router_topk_reference import mark_routed_reference, router_topk_reference

# (T, E, k, norm_topk_prob, shared gate column?, dtype, logits): "randn" distinct values, "ties"
# drawn from 4 values (most rows tie at the k-th place), "-inf" with most experts masked out
CASES = [
    (1, 8, 2, True, False, torch.float32, "randn"),
    (1, 8, 2, False, True, torch.bfloat16, "randn"),
    (3, 60, 4, True, True, torch.float32, "randn"),  # E not a power of two
    (3, 64, 6, False, False, torch.float32, "randn"),
    (17, 128, 8, True, False, torch.bfloat16, "randn"),
    (17, 256, 8, True, True, torch.bfloat16, "randn"),  # Qwen3.6-35B-A3B's router
    (17, 256, 8, False, True, torch.bfloat16, "randn"),
    (5, 512, 10, True, True, torch.bfloat16, "randn"),  # Qwen3-Next-80B's 512 experts, top 10
    (65, 32, 3, False, False, torch.float32, "randn"),  # many rows: a prefill's grid (one program a row)
    (17, 8, 3, True, True, torch.float32, "ties"),
    (17, 8, 3, False, False, torch.float32, "ties"),
    (17, 256, 8, True, True, torch.bfloat16, "ties"),
    (17, 256, 8, False, True, torch.bfloat16, "ties"),
    (3, 16, 4, True, False, torch.float32, "-inf"),
    (3, 16, 4, False, False, torch.float32, "-inf"),
]


def _logits(seed, t, e, shared, dtype, kind):
    g = torch.Generator().manual_seed(seed)
    cols = e + (1 if shared else 0)
    if kind == "ties":
        logits = torch.randint(0, 4, (t, cols), generator=g).float() * 0.5
    else:
        logits = torch.randn(t, cols, generator=g) * 2
    if kind == "-inf":  # one row with fewer finite logits than k: the rest tie at -inf
        logits[:, : e - 6] = float("-inf")
        logits[0, : e - 1] = float("-inf")
    return logits.to(dtype)


@pytest.fixture(scope="module")
def runs():
    calls, expected = [], []
    for i, (t, e, k, norm, shared, dtype, kind) in enumerate(CASES):
        logits = _logits(i, t, e, shared, dtype, kind)
        expected.append(router_topk_reference(logits, k, norm, e))
        out = (
            torch.full((t, k), -1, dtype=torch.int64),
            torch.full((t, k), float("nan"), dtype=dtype),
            torch.full((t, 1), float("nan"), dtype=dtype),
        )
        calls.append(((logits, k, norm, e), dict(out=out)))
    return list(zip(expected, run_interpreted("ferry.kernels.router_topk", "router_topk_triton", calls)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"T{c[0]}-E{c[1]}-k{c[2]}-norm{c[3]}-shared{c[4]}-{c[6]}" for c in CASES]
)
def test_router_kernel_matches_its_twin(runs, index):
    (want_ids, want_w, want_shared), (ids, w, shared) = runs[index]
    t, e, k, norm, has_shared, dtype, kind = CASES[index]
    assert ids.dtype == torch.int64 and w.dtype == dtype
    # the same experts in the same order, ties toward the lower expert id
    assert torch.equal(ids, want_ids), (ids, want_ids)
    assert not torch.isnan(w).any()
    # float32: the kernel's exp and sums differ from torch's by ulps; bf16: one rounding (the
    # interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest): one ulp
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(w.float(), want_w.float(), rtol=tol, atol=tol)
    if norm:
        torch.testing.assert_close(w.float().sum(-1), torch.ones(t), rtol=0, atol=k * tol)
    if has_shared:
        assert shared.shape == (t, 1) and not torch.isnan(shared).any()
        torch.testing.assert_close(shared.float(), want_shared.float(), rtol=tol, atol=tol)


def test_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 2.0]])
    ((ids, w, _),) = run_interpreted("ferry.kernels.router_topk", "router_topk_triton", [((logits, 4, True, 6), {})])
    assert ids.tolist() == [[1, 2, 4, 3]]
    assert torch.equal(ids, router_topk_reference(logits, 4, True, 6)[0])
    assert w[0, 0] == w[0, 1] == w[0, 2] > w[0, 3]


# (T, layers, E, k, layer, n_rows or None)
MARK_CASES = [
    (1, 3, 8, 2, 1, None),
    (3, 2, 6, 2, 1, 2),
    (17, 4, 256, 8, 3, 9),
    (17, 2, 60, 4, 0, 17),
    (5, 2, 8, 3, 1, 0),
]


@pytest.fixture(scope="module")
def mark_runs():
    calls, expected = [], []
    for i, (t, layers, e, k, layer, n) in enumerate(MARK_CASES):
        g = torch.Generator().manual_seed(50 + i)
        table = (torch.rand(layers, e, generator=g) < 0.2).to(torch.int32)  # earlier layers' marks stay
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        n_rows = None if n is None else torch.tensor([n], dtype=torch.int32)
        want = table.clone()
        mark_routed_reference(want, layer, ids, n_rows)
        expected.append(want)
        calls.append(((table, layer, ids, n_rows), {}))
    outs = run_interpreted("tests.unit.interpreted_router_marks", "mark_and_return", calls)
    return list(zip(expected, outs))


@pytest.mark.parametrize("index", range(len(MARK_CASES)))
def test_marking_kernel_matches_the_scatter(mark_runs, index):
    want, got = mark_runs[index]
    assert torch.equal(got, want)


# the sigmoid router: (T, E, k, norm_topk_prob, groups, topk_groups, scaling, bias?, weights' dtype, logits)
SIGMOID_CASES = [
    (1, 128, 8, True, 1, 1, 1.0, True, torch.bfloat16, "randn"),  # GLM-4.5-Air's router, one decode token
    (17, 160, 8, True, 1, 1, 2.5, True, torch.bfloat16, "randn"),  # GLM-4.6's: E not a power of two
    (17, 256, 8, True, 8, 4, 2.5, True, torch.bfloat16, "randn"),  # DeepSeek-V3's groups
    (5, 32, 6, False, 4, 2, 1.5, True, torch.float32, "randn"),
    (65, 16, 3, True, 2, 1, 1.0, False, torch.float32, "randn"),  # a prefill's grid, no bias
    (17, 32, 4, True, 4, 2, 1.0, False, torch.float32, "ties"),  # tied scores, tied groups: lower ids win
]


@pytest.fixture(scope="module")
def sigmoid_runs():
    from ferry.kernels.router_topk_reference import sigmoid_topk_reference

    calls, expected = [], []
    for i, (t, e, k, norm, groups, chosen, scaling, has_bias, dtype, kind) in enumerate(SIGMOID_CASES):
        logits = _logits(100 + i, t, e, False, torch.float32, kind)  # float32, as TopKRouter computes them
        g = torch.Generator().manual_seed(200 + i)
        bias = 0.5 * torch.randn(e, generator=g) if has_bias else None
        expected.append(sigmoid_topk_reference(logits, k, norm, bias, groups, chosen, scaling, dtype))
        out = (torch.full((t, k), -1, dtype=torch.int64), torch.full((t, k), float("nan"), dtype=dtype))
        calls.append(((logits, k, norm, e, out, bias, groups, chosen, scaling, dtype), {}))
    return list(zip(expected, run_interpreted("tests.unit.interpreted_router_marks", "sigmoid_route", calls)))


@pytest.mark.parametrize(
    "index",
    range(len(SIGMOID_CASES)),
    ids=[f"T{c[0]}-E{c[1]}-k{c[2]}-norm{c[3]}-groups{c[5]}of{c[4]}-bias{c[7]}-{c[9]}" for c in SIGMOID_CASES],
)
def test_sigmoid_router_kernel_matches_its_twin(sigmoid_runs, index):
    (want_ids, want_w), (ids, w, shared) = sigmoid_runs[index]
    t, e, k, norm, groups, chosen, scaling, _, dtype, _ = SIGMOID_CASES[index]
    assert shared is None and ids.dtype == torch.int64 and w.dtype == dtype
    assert torch.equal(ids, want_ids), (ids, want_ids)
    if chosen < groups:  # every row's experts come from `chosen` groups
        assert all(len({int(i) // (e // groups) for i in row}) <= chosen for row in ids)
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(w.float(), want_w.float(), rtol=tol, atol=tol * scaling)
    if norm:
        torch.testing.assert_close(w.float().sum(-1), torch.full((t,), scaling), rtol=0, atol=k * tol * scaling)
