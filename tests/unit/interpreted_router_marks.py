"""Child-side helpers of test_kernel_router_topk.py: the marking kernel writes into its table in
place, so the child returns the table (run_interpreted returns what the function returns); the sigmoid
router's settings cross as plain values (the call's arguments are loaded weights_only) and are built here."""

from __future__ import annotations

from ferry.kernels.router_topk import SigmoidRouting, mark_routed_triton, router_topk_triton


def mark_and_return(table, layer, topk_ids, n_rows):
    mark_routed_triton(table, layer, topk_ids, n_rows)
    return table


def sigmoid_route(logits, top_k, norm_topk_prob, num_experts, out, bias, groups, topk_groups, scaling, dtype):
    routing = SigmoidRouting(bias, groups, topk_groups, scaling, dtype)
    return router_topk_triton(logits, top_k, norm_topk_prob, num_experts, out, routing)
