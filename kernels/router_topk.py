"""The MoE router after its linear, in one Triton launch per MoE block; and the marking of the routed
experts in the resident store's table, in another.

Twin: kernels/router_topk_reference.py (the CPU path, and the tests' oracle).

In plain torch a one-token decode step spends ~6 launches of 1-5 us between the router's logits and
the expert GEMVs (topk's gather and sort, a copy, softmax, a cast, then the shared expert gate's
sigmoid), and ~5 more marking the routed experts for the resident store's statistics (ones, arange,
compare, cast, scatter). At one token those launches, not the bytes, are the step's cost.

`router_topk_triton` reads the [T, E] logits, or [T, E + 1] when the block has a shared expert
(the router and the shared expert's gate are one [E + 1, hidden] weight, so one GEMV gives both),
and for each row: softmax in float32 / top k / renormalise exactly as the twin does (both
`norm_topk_prob` variants), ties toward the lower expert id; writes the ids (int64, as torch.topk
returns them), the weights (rounded once to the model dtype) and sigmoid(gate logit) (rounded to
the model dtype, as torch.sigmoid of a model-dtype tensor is). One program per row: the row's E
logits (up to a few hundred) fit in registers, and the selection is k block-wide max/argmin
reductions. The token count only sets the grid, so a prefill chunk of thousands of rows and a
decode step of one run the same compiled kernel (no compile while serving).

With `sigmoid` (GLM-4.5, DeepSeek-V3 style routers) the same program scores each expert by the sigmoid
of its float32 logit, chooses the top k by score + bias among the best groups (a group's score is the sum
of its two best; the groups' loop is unrolled, one reduction pair a group), and writes the chosen experts'
unbiased scores, renormalised and scaled.

`mark_routed_triton` sets table[layer, e] = 1 for every expert routed by a row < n_rows (a device
scalar: graph-safe, and padding rows of a CUDA graph's batch are left out). Every writer stores 1,
so concurrent writes of the same entry are harmless. The layer is a runtime argument, never
specialised on, and the table's base pointer is the same for every layer (a row's pointer would
change alignment class from layer to layer when E * 4 bytes is not a multiple of 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferry.kernels.dispatch import use_triton
from ferry.kernels.router_topk_reference import mark_routed_reference, router_topk_reference


@dataclass(frozen=True)
class SigmoidRouting:
    """The sigmoid router's settings (ModelSpec's router_* fields); `dtype`: its weights' dtype (the model's)."""

    score_bias: torch.Tensor | None  # float32 [E], added for choosing only
    groups: int
    topk_groups: int
    scaling: float
    dtype: torch.dtype


@triton.jit
def _router_topk_kernel(
    logits_ptr,
    ids_ptr,
    weights_ptr,
    shared_ptr,
    bias_ptr,
    stride_t,
    E,
    group_size,
    scaling,
    TOP_K: tl.constexpr,
    NORM_TOPK: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False,
    GROUPS: tl.constexpr = 1,
    TOPK_GROUPS: tl.constexpr = 1,
    BLOCK_G: tl.constexpr = 1,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    real = offs < E
    row = logits_ptr + t * stride_t
    logits = tl.load(row + offs, mask=real, other=float("-inf")).to(tl.float32)
    scores = logits
    if SIGMOID:
        # the weights are the scores; the choice adds the bias and keeps only the best groups' experts
        scores = tl.where(real, 1.0 / (1.0 + tl.exp(-logits)), 0.0)
        values = scores
        if HAS_BIAS:
            values = scores + tl.load(bias_ptr + offs, mask=real, other=0.0).to(tl.float32)
        values = tl.where(real, values, float("-inf"))
        if TOPK_GROUPS < GROUPS:
            group = offs // group_size
            gg = tl.arange(0, BLOCK_G)
            group_scores = tl.full([BLOCK_G], float("-inf"), tl.float32)
            for g in tl.static_range(GROUPS):  # a group's score: its two best values' sum
                v = tl.where(real & (group == g), values, float("-inf"))
                first = tl.max(v, axis=0)
                at = tl.min(tl.where(v == first, offs, BLOCK_E), axis=0)
                second = tl.max(tl.where(offs == at, float("-inf"), v), axis=0)
                group_scores = tl.where(gg == g, first + second, group_scores)
            keep = offs < 0
            group_taken = gg >= GROUPS
            # the best groups, ties toward the lower group (names apart from the experts' loop below, whose
            # loop-carried values must keep their types)
            for _ in tl.static_range(TOPK_GROUPS):
                open_groups = tl.where(group_taken, float("-inf"), group_scores)
                best_group = tl.max(open_groups, axis=0)
                picked = tl.min(tl.where((open_groups == best_group) & (~group_taken), gg, BLOCK_G), axis=0)
                group_taken = group_taken | (gg == picked)
                keep = keep | (group == picked)
            values = tl.where(keep, values, float("-inf"))
    elif NORM_TOPK:
        # selected on the model-dtype logits (as the twin's top-k of the logits), softmax after
        values = logits
    else:
        # the float32 probabilities over all experts, then the k largest of them (as the twin):
        # selecting on these rather than on the logits matters only where exp underflows to 0
        e = tl.exp(logits - tl.max(logits, axis=0))  # padding: exp(-inf) = 0
        values = e / tl.sum(e, axis=0)
    kk = tl.arange(0, BLOCK_K)
    top_values = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    # `taken` rather than overwriting picked values with -inf: a real -inf logit (or 0 probability)
    # must still lose only to larger values and to lower ids, never be picked twice
    taken = offs >= E
    for j in range(TOP_K):
        candidates = tl.where(taken, float("-inf"), values)
        best = tl.max(candidates, axis=0)
        pick = tl.min(tl.where((candidates == best) & (~taken), offs, BLOCK_E), axis=0)  # ties: the lower id
        pick = tl.minimum(pick, E - 1)  # NaN logits match nothing: stay in range whatever they hold
        if SIGMOID:  # the chosen expert's unbiased score
            best = tl.sum(tl.where(offs == pick, scores, 0.0), axis=0)
        top_values = tl.where(kk == j, best, top_values)
        top_ids = tl.where(kk == j, pick, top_ids)
        taken = taken | (offs == pick)
    chosen = kk < TOP_K
    if SIGMOID:
        if NORM_TOPK:
            top_values = top_values / (tl.sum(tl.where(chosen, top_values, 0.0), axis=0) + 1e-20)
        top_values = top_values * scaling
    elif NORM_TOPK:  # softmax over the k chosen logits (the first is their maximum), in float32
        e = tl.where(chosen, tl.exp(top_values - tl.max(tl.where(chosen, top_values, float("-inf")), axis=0)), 0.0)
        top_values = e / tl.sum(e, axis=0)
    tl.store(ids_ptr + t * TOP_K + kk, top_ids.to(tl.int64), mask=chosen)
    tl.store(weights_ptr + t * TOP_K + kk, top_values.to(weights_ptr.dtype.element_ty), mask=chosen)
    if HAS_SHARED:
        g = tl.load(row + E).to(tl.float32)
        tl.store(shared_ptr + t, (1.0 / (1.0 + tl.exp(-g))).to(shared_ptr.dtype.element_ty))


def router_topk_triton(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    num_experts: int,
    out: tuple[torch.Tensor, ...] | None = None,
    sigmoid: SigmoidRouting | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits [T, E] or [T, E + 1] (unit stride along experts) -> (ids int64 [T, k], weights [T, k]
    in logits' dtype, sigmoid of the last column [T, 1] or None). `out`: (ids, weights[, shared])
    to write into (tests poison them), new tensors by default. `sigmoid`: the sigmoid router instead of
    the softmax (its score bias, groups and scaling; the twin is `sigmoid_topk_reference`), its weights
    in `sigmoid.dtype`."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[1] not in (num_experts, num_experts + 1):
        raise ValueError(f"router logits {tuple(logits.shape)} stride {logits.stride()} for {num_experts} experts")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} for {num_experts} experts")
    groups = sigmoid.groups if sigmoid else 1
    topk_groups = sigmoid.topk_groups if sigmoid else 1
    if num_experts % groups or not 0 < topk_groups <= groups:
        raise ValueError(f"{topk_groups} of {groups} expert groups for {num_experts} experts")
    t, cols = logits.shape
    has_shared = cols == num_experts + 1
    bias = sigmoid.score_bias if sigmoid else None
    if out is None:
        ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
        weights = torch.empty(t, top_k, dtype=sigmoid.dtype if sigmoid else logits.dtype, device=logits.device)
        shared = torch.empty(t, 1, dtype=logits.dtype, device=logits.device) if has_shared else None
    else:
        ids, weights, *rest = out
        shared = rest[0] if has_shared else None
    if t:
        block_e = triton.next_power_of_2(num_experts)
        # the k selections are 2k dependent block-wide reductions: within one warp they are register
        # shuffles, across warps each also needs shared memory and a barrier (a row of up to 512
        # experts is 16 values a thread in one warp)
        _router_topk_kernel[(t,)](
            logits,
            ids,
            weights,
            shared if shared is not None else weights,
            bias if bias is not None else logits,
            logits.stride(0),
            num_experts,
            num_experts // groups,
            float(sigmoid.scaling) if sigmoid else 1.0,
            TOP_K=top_k,
            NORM_TOPK=norm_topk_prob,
            HAS_SHARED=has_shared,
            BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k),
            SIGMOID=sigmoid is not None,
            HAS_BIAS=bias is not None,
            GROUPS=groups,
            TOPK_GROUPS=topk_groups,
            BLOCK_G=triton.next_power_of_2(groups),
            num_warps=max(1, min(4, block_e // 512)),
        )
    return ids, weights, shared


def router_topk(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if use_triton(logits):
        return router_topk_triton(logits, top_k, norm_topk_prob, num_experts)
    return router_topk_reference(logits, top_k, norm_topk_prob, num_experts)


# The layer varies from call to call: specialising on it (Triton's ==1 and multiple-of-16 classes)
# would compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["layer"])
def _mark_routed_kernel(
    ids_ptr,
    n_rows_ptr,
    table_ptr,
    stride_t,
    layer,
    E,
    TOP_K: tl.constexpr,
    HAS_N_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    kk = tl.arange(0, BLOCK_K)
    ok = kk < TOP_K
    if HAS_N_ROWS:
        ok = ok & (tl.full([BLOCK_K], t, dtype=tl.int32) < tl.load(n_rows_ptr))
    ids = tl.load(ids_ptr + t.to(tl.int64) * stride_t + kk, mask=ok, other=0)
    tl.store(table_ptr + layer * E + ids, tl.full([BLOCK_K], 1, dtype=tl.int32), mask=ok)


@triton.jit
def mark_routed_slot(table_ptr, n_rows_ptr, slot, token, HAS_N_ROWS: tl.constexpr):
    """The same mark from inside an expert kernel that already holds the pair's slot: table[slot] = 1
    unless the pair's token is padding (>= n_rows). For the resident store, whose slot of (layer, e)
    is layer * E + e, the table's entry of that expert (kernels/expert_pair_gemv.py: one launch a
    MoE layer fewer at decode)."""
    if HAS_N_ROWS:
        if token < tl.load(n_rows_ptr):
            tl.store(table_ptr + slot, 1)
    else:
        tl.store(table_ptr + slot, 1)


def mark_args(
    mark: tuple[torch.Tensor, torch.Tensor | None] | None, fallback: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (table, n_rows) pointers an expert kernel marking with `mark_routed_slot` takes, checked;
    `fallback` stands in for what is absent (never read: the kernel's constexprs say so)."""
    if mark is None:
        return fallback, fallback
    table, n_rows = mark
    if table.dtype != torch.int32 or not table.is_contiguous():
        raise ValueError("the routed table must be a contiguous int32 tensor")
    if n_rows is not None and (n_rows.dtype != torch.int32 or n_rows.numel() != 1):
        raise ValueError("n_rows must be an int32 [1] tensor")
    return table, (n_rows if n_rows is not None else fallback)


def mark_routed_triton(table: torch.Tensor, layer: int, topk_ids: torch.Tensor, n_rows: torch.Tensor | None) -> None:
    """table: contiguous int32 [layers, E]; topk_ids [T, k] (unit stride along k); n_rows: int32 [1]
    on the device, or None (every row is real)."""
    if table.dtype != torch.int32 or not table.is_contiguous() or table.dim() != 2:
        raise ValueError("the routed table must be a contiguous int32 [layers, experts] tensor")
    if topk_ids.stride(-1) != 1:
        topk_ids = topk_ids.contiguous()
    t, k = topk_ids.shape
    if t:
        _mark_routed_kernel[(t,)](
            topk_ids,
            n_rows if n_rows is not None else table,
            table,
            topk_ids.stride(0),
            layer,
            table.shape[1],
            TOP_K=k,
            HAS_N_ROWS=n_rows is not None,
            BLOCK_K=triton.next_power_of_2(k),
            num_warps=1,
        )


def mark_routed(table: torch.Tensor, layer: int, topk_ids: torch.Tensor, n_rows: torch.Tensor | None) -> None:
    if use_triton(topk_ids):
        mark_routed_triton(table, layer, topk_ids, n_rows)
    else:
        mark_routed_reference(table, layer, topk_ids, n_rows)
