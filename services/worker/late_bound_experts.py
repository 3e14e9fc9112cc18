"""An ExpertStore handle the model can be built with before the expert pool exists.

Boot builds the model and loads its dense weights *before* the planner sizes the expert pool
(docs/ARCHITECTURE.md §2 rule 3: weights are measured, then planned around). The model keeps a reference to
its store, so it is given this handle, and the real store — resident slots, a profiling store,
or the offload engine — is bound to it once it exists. Using it unbound is a boot-order bug."""

from __future__ import annotations

import torch

from ferry.kernels.expert_rows_sum import ExpertRows
from ferry.services.worker.offload.stores.expert_store import ExpertStore
from ferry.services.worker.offload.stores.resident import ResidentExperts
from ferry.services.worker.pools import ExpertSlotPool


class LateBoundExperts:
    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._store: ExpertStore | None = None

    def bind(self, store: ExpertStore) -> None:
        if store.num_experts != self.num_experts:
            raise ValueError(f"store has {store.num_experts} experts per layer, the model {self.num_experts}")
        self._store = store

    def unbind(self) -> None:
        self._store = None

    @property
    def store(self) -> ExpertStore:
        if self._store is None:
            raise RuntimeError("the expert store is not bound yet: experts are used before boot allocated their pool")
        return self._store

    def load_expert(
        self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bias=None
    ) -> None:
        self.store.load_expert(moe_layer, expert, gate, up, down, *(() if bias is None else (bias,)))

    def forward(
        self,
        moe_layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        n_rows: torch.Tensor | None = None,
        summed: bool = True,
    ) -> torch.Tensor | ExpertRows:
        return self.store.forward(moe_layer, x, topk_ids, topk_weights, n_rows=n_rows, summed=summed)

    def count_step_on_device(self) -> None:
        self.store.count_step_on_device()


class SharedLayerExperts(ResidentExperts):
    """One MoE layer's worth of slots serving every layer: the store of the workspace-profiling
    step, which needs the expert compute's real activation memory but not real expert weights."""

    def __init__(self, slots: ExpertSlotPool, num_experts: int):
        super().__init__(slots, 1, num_experts)

    def forward(
        self,
        moe_layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        n_rows: torch.Tensor | None = None,
        summed: bool = True,
    ) -> torch.Tensor | ExpertRows:
        return super().forward(0, x, topk_ids, topk_weights, n_rows=n_rows, summed=summed)
