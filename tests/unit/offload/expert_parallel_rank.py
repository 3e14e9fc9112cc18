"""One rank of test_expert_parallel.py's group (gloo on CPU): argv rank, world, the rendezvous file, experts a
layer (several, comma-separated: one group after another in this process, each through its own rendezvous file,
so a world size's cases cost one process boot a rank). For each: builds the rank's offloading store of its own
experts, runs decode and prefill steps through ExpertParallelExperts and the all-resident store of every expert on
the same routing, and prints a JSON line: {"max_diff": ..., "digest": a hash of its outputs (the same on every
rank), "misses": its local misses, "rank", "experts"}."""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch.distributed as dist
from offload_tiny import random_experts, random_routing, slot_pool, tiny_spec

from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.slot_cache.policy import LRUExpertPolicy
from ferry.services.worker.offload.stores.expert_parallel import ExpertParallelExperts, owned_count
from ferry.services.worker.offload.stores.offloaded import OffloadedExperts
from ferry.services.worker.offload.stores.resident import ResidentExperts


def main() -> None:
    rank, world, rendezvous = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    for experts in (int(e) for e in sys.argv[4].split(",")):
        run_group(rank, world, f"{rendezvous}-{experts}", experts)


def run_group(rank: int, world: int, rendezvous: str, experts: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    layers, top_k = 2, 3
    spec = tiny_spec(layers=layers, experts=experts, top_k=top_k, hidden=32, inter=16)
    mine = owned_count(experts, rank, world)
    local_spec = tiny_spec(layers=layers, experts=mine, top_k=1, hidden=32, inter=16)
    slots = mine + 1  # fewer than the layers' owned experts: misses cross from the host banks
    local = OffloadedExperts(
        slot_pool(local_spec, slots),
        HostBanks.for_model(local_spec, "float32", progress=False),
        LRUExpertPolicy(layers, mine, slots),
        "cpu",
    )
    store = ExpertParallelExperts(local, rank, world, experts)
    resident = ResidentExperts(slot_pool(spec, layers * experts), layers, experts)
    for (layer, e), weights in random_experts(spec, 5).items():
        store.load_expert(layer, e, *weights)
        resident.load_expert(layer, e, *weights)
    store.preload()
    g = torch.Generator().manual_seed(11)  # the same routing on every rank
    digest, worst = hashlib.sha256(), 0.0
    for tokens, real in ((1, 1), (4, 3), (1, 1), (40, 40), (2, 2)):
        for layer in range(layers):
            x, ids, w = random_routing(spec, tokens, g)
            got = store.forward(layer, x, ids, w, n_rows=torch.tensor([real], dtype=torch.int32))
            want = resident.forward(layer, x, ids, w)
            worst = max(worst, float((got[:real] - want[:real]).abs().max()))
            digest.update(got[:real].numpy().tobytes())
        store.end_step()
    print(
        json.dumps(
            {
                "max_diff": worst,
                "digest": digest.hexdigest(),
                "misses": store.report()["misses"],
                "rank": store.report()["expert_parallel"]["rank"],
                "experts": experts,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
