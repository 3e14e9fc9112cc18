"""The all-resident store, computed with the dispatching grouped expert GEMM (Triton on CUDA).

`services/worker/experts.ResidentExperts` always runs the reference twin, a Python loop over
slots that is right everywhere but slow on a GPU. When the plan gives every expert a slot, boot
gets this subclass instead: same slots, same loading, the kernel `OffloadedExperts` uses. On
CPU the dispatcher picks the same reference, so the two are bit for bit the same there.
"""

from __future__ import annotations

import torch

from kernels.grouped_expert_gemm import grouped_expert_forward
from services.worker.experts import ResidentExperts


class KernelResidentExperts(ResidentExperts):
    def forward(self, moe_layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        topk_slots = topk_ids + moe_layer * self.num_experts
        return grouped_expert_forward(x, topk_slots, topk_weights, self.slots.w13, self.slots.w2,
                                      max_distinct_slots=self.num_experts)  # one layer's experts at most
