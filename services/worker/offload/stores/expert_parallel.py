"""Experts partitioned across the ranks of a torch.distributed group.

Rank r of `world` owns expert e of every MoE layer when e % world == r: its slots, host banks and copies
hold only those (its own PCIe link fetches its own misses). Dense weights, attention and the KV cache are
replicated, so every rank holds every token's hidden state; per MoE layer each rank computes the (token,
k) pairs routed to its experts and the ranks sum their partial outputs (one all-reduce of [T, H] float32:
a few KB a token a layer, what crosses NVLink between two GPUs). No hidden state is sent to an owner, since
every rank already has it.

`ExpertParallelExperts` is an ExpertStore (expert_store.py) over a local store of the owned
experts, local id e // world. The owned pairs are gathered into rows of one pair each (top_k 1 for the
local store: a token's owned pairs vary in number), computed and weighted by the local store as it
computes any pair (each comes back in the activation dtype), added into their tokens' rows in float32,
summed over the ranks and rounded to the activation dtype. In float32 that is a single store's sum up to
its order; in bf16 each pair is rounded once more than there. The all-reduce hands every rank the same
sum, so the ranks go on with the same hidden states.

Eager only: gathering the owned pairs reads their count on the host. The CUDA graph form (fixed-size pair
lists, NCCL inside the capture) is the next step. The worker runs one process a rank
(services/worker/expert_ranks.py), each planned for its own experts (plan/expert_parallel.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def owned_count(num_experts: int, rank: int, world: int) -> int:
    """How many of a layer's experts rank `rank` of `world` owns (e % world == rank)."""
    return len(range(rank, num_experts, world))


class ExpertParallelExperts:
    """The ExpertStore of rank `rank` of `world` (module docstring): `local` holds this rank's experts of
    every MoE layer (owned_count of `num_experts`, local id e // world); `group`: the process group the
    partial outputs are summed over (None: the default group)."""

    def __init__(self, local, rank: int, world: int, num_experts: int, group=None):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a group of {world}")
        if local.num_experts != owned_count(num_experts, rank, world):
            raise ValueError(
                f"rank {rank} of {world} owns {owned_count(num_experts, rank, world)} of {num_experts} "
                f"experts a layer; its store has {local.num_experts}"
            )
        self.local, self.rank, self.world, self.num_experts, self.group = local, rank, world, num_experts, group

    def __getattr__(self, name: str):
        """What boot and the executor read of a store beyond the ExpertStore calls (stats, copy_engine_tokens,
        ...) is the local store's: this one holds only the partition."""
        if name == "local":  # not yet set (unpickling, a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def banks(self):
        """The local store's host banks (None: it offloads nothing): boot fills them with dummy weights."""
        return getattr(self.local, "banks", None)

    @property
    def slots(self):
        return self.local.slots

    def fill_dummy(self, seed: int) -> None:
        self.local.fill_dummy(seed)

    def owns(self, expert: int) -> bool:
        return expert % self.world == self.rank

    def load_expert(
        self, moe_layer: int, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bias=None
    ) -> None:
        """Every rank is offered every expert (the loader reads the checkpoint once a rank); it keeps its own."""
        if self.owns(expert):
            self.local.load_expert(moe_layer, expert // self.world, gate, up, down, *(() if bias is None else (bias,)))

    def set_routers(self, routers: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> None:
        """The next-layer prediction of an offloading local store: the router rows (and biases) of the owned
        experts."""
        if hasattr(self.local, "set_routers"):
            owned = None if biases is None else [None if b is None else b[self.rank :: self.world] for b in biases]
            self.local.set_routers([r[self.rank :: self.world] for r in routers], owned)

    def forward(
        self,
        moe_layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        n_rows: torch.Tensor | None = None,
        summed: bool = True,
    ) -> torch.Tensor:
        """Always summed (`summed` is the protocol's): the ranks' partial sums are all-reduced."""
        t, _ = topk_ids.shape
        own = topk_ids % self.world == self.rank
        if n_rows is not None:  # padding rows: nobody computes them
            own &= torch.arange(t, device=x.device).unsqueeze(1) < n_rows.to(x.device)
        tok, j = own.nonzero(as_tuple=True)
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        if tok.numel():
            rows = self.local.forward(
                moe_layer, x[tok], (topk_ids[tok, j] // self.world).unsqueeze(1), topk_weights[tok, j].unsqueeze(1)
            )
            out.index_add_(0, tok, rows.float())
        dist.all_reduce(out, group=self.group)
        return out.to(x.dtype)

    # the step's bookkeeping is the local store's
    def preload(self) -> int:
        return self.local.preload()

    def begin_step(self, num_tokens: int, top_k: int, long_context: bool = False) -> None:
        """Nothing started early: how many pairs a rank gets is known only from the routing, and the local
        store decides its path (decode, copies, streaming) by that count at the first layer."""

    def count_step_on_device(self) -> None:
        self.local.count_step_on_device()

    def stats_to_host(self, counted: bool = False) -> None:
        self.local.stats_to_host(counted)

    def end_step(self, synced: bool = False, decode_tokens: int | None = None) -> None:
        self.local.end_step(synced, decode_tokens)

    def report(self) -> dict:
        return {**self.local.report(), "expert_parallel": {"rank": self.rank, "world": self.world}}
