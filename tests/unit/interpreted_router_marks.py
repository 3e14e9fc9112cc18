"""Child-side helper of test_kernel_router_topk.py: the marking kernel writes into its table in
place, so the child returns the table (run_interpreted returns what the function returns)."""

from __future__ import annotations

from ferry.kernels.router_topk import mark_routed_triton


def mark_and_return(table, layer, topk_ids, n_rows):
    mark_routed_triton(table, layer, topk_ids, n_rows)
    return table
