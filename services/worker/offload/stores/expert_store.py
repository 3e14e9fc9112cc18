"""Where a MoE layer's routed experts are computed: the `ExpertStore` interface.

Models call `store.forward(moe_layer, x, topk_ids, topk_weights)` and never see slots. A store
maps (moe_layer, expert) to a slot of the planner-sized `ExpertSlotPool` and runs the grouped
expert GEMM by slot. Two stores implement it: `offload/stores/resident.py:ResidentExperts` for a plan
that gives every expert a slot, and `offload/stores/offloaded.py:OffloadedExperts` for fewer slots than experts
(misses copied from host banks). Boot picks one (`offload/stores/build.py`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ferry.kernels.expert_rows_sum import ExpertRows

# A prefill chunk of at least LEND_QUERY_TOKENS new tokens whose request reaches LEND_CONTEXT_TOKENS keys
# lends its ring cache slots (offload/stores/device_driven.py, `_slots_to_lend`): its full-attention layers then
# compute for longer than their experts take to cross (an 8,192-token chunk at 32k keys: ~15 ms a layer
# against ~19 ms of one layer's streamed experts, growing with the context), so without room ahead
# the copy stream would wait through every such layer.
LEND_QUERY_TOKENS = 1024
LEND_CONTEXT_TOKENS = 32768


def is_long_context(query_lens, context_lens) -> bool:
    """Whether a step's prefill lends its ring cache slots (see LEND_CONTEXT_TOKENS)."""
    return any(q >= LEND_QUERY_TOKENS and q + c >= LEND_CONTEXT_TOKENS for q, c in zip(query_lens, context_lens))


class ExpertStore(Protocol):
    num_experts: int

    def load_expert(
        self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bias=None
    ) -> None:
        """Take one expert's weights: gate and up [I, H], down [H, I] (checkpoint layout), and its biases
        (expert_formats/expert_shapes.py's ExpertBias) where the model's experts have them."""

    def forward(
        self,
        moe_layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        n_rows: torch.Tensor | None = None,
        summed: bool = True,
    ) -> torch.Tensor | ExpertRows:
        """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token t; [T, H] in x's dtype.
        `n_rows` (int32 [1] on the device): rows past it are padding, whose output is never read
        and whose experts must not be fetched or counted. `summed=False`: the store may return its
        unsummed rows instead (`ExpertRows`, kernels/expert_rows_sum.py: only a decode-sized step on the
        Triton path does), for the next kernel to sum."""

    def preload(self) -> int:
        """After every expert is loaded: warm the slots; returns how many experts were placed."""

    def begin_step(self, num_tokens: int, top_k: int, long_context: bool = False) -> None:
        """An eager step of `num_tokens` tokens (no padding), `top_k` experts each, is about to run
        (the executor calls it before the model's first layer; CUDA graph replays never do). A
        store may start the step's expert copies now, while the first layer's attention computes.
        `long_context`: a prefill chunk far into a long prompt (device_store.is_long_context)."""

    def count_step_on_device(self) -> None:
        """The device work that closes a step's statistics, graph-safe (no host values): a decode
        graph holds it after its forward; `stats_to_host` runs it for any other step."""

    def stats_to_host(self, counted: bool = False) -> None:
        """Queue the copy of the step's device-side statistics to the host (no waiting): the
        executor calls it before the step's one synchronisation, `end_step` after it. `counted`:
        the step's `count_step_on_device` already ran (inside its graph)."""

    def end_step(self, synced: bool = False, decode_tokens: int | None = None) -> None:
        """The executor's step is over (its results are on the host): close the step's statistics.
        `synced`: everything queued before has completed (no need to wait for `stats_to_host`);
        `decode_tokens`: the step's tokens if every row decoded one, else None (auto's guard over the
        host's decode share times such steps: offload/host_compute/share_guard.py)."""

    def report(self) -> dict:
        """Cumulative statistics (hits, misses, hit_rate, bytes_copied, copy_time_s,
        exposed_copy_time_s, steps, last_step) and what the cache is (policy, slots, ...)."""
