"""Plain-torch twins of kernels/router_topk.py: the MoE router's softmax / top-k / renormalisation,
and the marking of a layer's routed experts in the resident store's [layers, experts] table.

These are the CPU path (TopKRouter, ResidentExperts) and the kernels' oracles in the tests; the sigmoid
router (`sigmoid_topk_reference`: score bias, expert groups, scaled weights) is the same kernel's twin.

Routing is softmax over all experts (float32), keep the top k, optionally renormalise them to sum
to 1. Renormalised, that is exp(l_i) / sum over the top k of exp(l_j): a softmax over the top-k
logits alone, which is how it is computed (softmax is monotonic, so the same experts are picked;
equal up to float rounding). Without renormalisation the k largest float32 probabilities are kept.

The top k are chosen by a stable descending sort, not `torch.topk`: the two agree bit for bit
whenever the k-th value is not tied, and with ties `torch.topk` on CPU returns an arbitrary one of
the tied experts (and in an arbitrary order), while the kernel breaks ties toward the lower expert
id. A stable sort gives exactly that, so the twin and the kernel are comparable on ties too.
"""

from __future__ import annotations

import torch


def router_topk_reference(
    logits: torch.Tensor, top_k: int, norm_topk_prob: bool, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits [T, E] or [T, E + 1] (the last column the shared expert's gate logit), model dtype.
    Returns (ids int64 [T, k], weights [T, k] in logits' dtype, sigmoid(gate logit) [T, 1] in
    logits' dtype or None)."""
    routed = logits[:, :num_experts]
    if norm_topk_prob:
        top, ids = _top_k(routed, top_k)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
    else:
        weights, ids = _top_k(torch.softmax(routed, dim=-1, dtype=torch.float32), top_k)
    shared = torch.sigmoid(logits[:, num_experts:]) if logits.shape[1] > num_experts else None
    return ids, weights.to(logits.dtype), shared


def _top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest, descending, ties toward the lower index."""
    ordered, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered[:, :k], order[:, :k]


def mark_routed_reference(table: torch.Tensor, layer: int, topk_ids: torch.Tensor, n_rows: torch.Tensor | None) -> None:
    """table[layer, e] = 1 for every expert e routed by a row < n_rows (all rows when None); the
    other entries are left as they are. One scatter, no host sync (n_rows stays on the device)."""
    t, k = topk_ids.shape
    marks = torch.ones(t, k, dtype=table.dtype, device=topk_ids.device)
    if n_rows is not None:
        marks = (torch.arange(t, device=topk_ids.device) < n_rows)[:, None].expand(t, k).to(table.dtype)
    table[layer].scatter_reduce_(0, topk_ids.reshape(-1).to(torch.int64), marks.reshape(-1), reduce="amax")


def sigmoid_topk_reference(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    score_bias: torch.Tensor | None,
    groups: int,
    topk_groups: int,
    scaling: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid router (GLM-4.5, DeepSeek-V3 style) from its logits [T, E]: scores sigmoid(logits) in
    float32; the top k chosen by score + `score_bias` (per expert, None: no bias) among the `topk_groups`
    of `groups` equal groups whose two best biased scores sum highest; their weights the unbiased scores,
    renormalised to sum to 1 where `norm_topk_prob` (+1e-20, as transformers), times `scaling`.
    Returns (ids int64 [T, k], weights [T, k] in `dtype`); ties toward the lower index, as `_top_k`."""
    scores = torch.sigmoid(logits.float())
    choice = scores if score_bias is None else scores + score_bias.float()
    if topk_groups < groups:
        t, e = choice.shape
        best_two, _ = _top_k(choice.reshape(t * groups, e // groups), 2)
        _, chosen = _top_k(best_two.sum(dim=-1).view(t, groups), topk_groups)
        keep = torch.zeros(t, groups, dtype=torch.bool, device=choice.device).scatter_(1, chosen, True)
        keep = keep[:, :, None].expand(t, groups, e // groups).reshape(t, e)  # no host sync: graph-safe
        choice = choice.masked_fill(~keep, float("-inf"))
    _, ids = _top_k(choice, top_k)
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, (weights * scaling).to(dtype)
