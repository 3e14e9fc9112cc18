"""One rank of test_expert_parallel_decode.py (gloo on CPU): argv rank, world, rendezvous file, tiny model
directory, prompt ids (comma separated). Boots the tiny model on CPU in float32 with every expert resident,
decodes the prompt greedily (the one-rank answer), then rebinds the model's MoE layers to an
ExpertParallelExperts over an offloading store of this rank's own experts (copied out of the resident
slots, fewer slots than it owns) and decodes again. Prints JSON {"one_rank": ids, "ranks": ids, "misses": n}."""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from ferry.plan import pool_layout as L
from ferry.plan.planner import PlanRequest
from ferry.services.generate_command import generate
from ferry.services.worker.boot import boot_worker
from ferry.services.worker.flags import WorkerBootConfig
from ferry.services.worker.offload.host_memory.host_banks import HostBanks
from ferry.services.worker.offload.slot_cache.policy import LRUExpertPolicy
from ferry.services.worker.offload.stores.expert_parallel import ExpertParallelExperts, owned_count
from ferry.services.worker.offload.stores.offloaded import OffloadedExperts
from ferry.services.worker.pools import ExpertSlotPool, allocate_pool
from ferry.shared.eos import eos_token_ids
from ferry.shared.sampling import SamplingParams


def main() -> None:
    rank, world, rendezvous, model_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    prompt = [int(t) for t in sys.argv[5].split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    cfg = WorkerBootConfig(
        model=model_dir,
        device="cpu",
        plan=PlanRequest(dtype="float32", num_pages=64, max_model_len=256, max_running_requests=4),
    )
    executor, _ = boot_worker(cfg)
    greedy, eos = SamplingParams(temperature=0.0, ignore_eos=True), eos_token_ids(model_dir)
    one_rank, _, _ = generate(executor, prompt, greedy, 12, eos)

    spec, resident = executor.spec, executor.store
    layers, experts = len(spec.moe_layer_indices), spec.num_experts
    mine = owned_count(experts, rank, world)
    local_spec = dataclasses.replace(spec, num_experts=mine, num_experts_per_tok=1)
    slots = mine + 1  # fewer than the layers' owned experts: misses cross from this rank's host banks
    pool = ExpertSlotPool(allocate_pool(L.expert_slot_layout(local_spec, "float32", slots, 64), "cpu"))
    local = OffloadedExperts(
        pool,
        HostBanks.for_model(local_spec, "float32", pin=False, progress=False),
        LRUExpertPolicy(layers, mine, slots),
        "cpu",
    )
    store = ExpertParallelExperts(local, rank, world, experts)
    inter = spec.moe_intermediate_size
    for layer in range(layers):
        for e in range(experts):
            s = resident._slot(layer, e)
            w13, w2 = resident.slots.w13[s], resident.slots.w2[s]
            store.load_expert(layer, e, w13[:inter], w13[inter:], w2)
    store.preload()
    for block in executor.model.modules():
        if hasattr(block, "moe_layer") and hasattr(block, "experts"):
            block.experts.bind(store)  # the model's one late-bound handle
    executor.store = store
    ranks, _, _ = generate(executor, prompt, greedy, 12, eos)
    print(json.dumps({"one_rank": one_rank, "ranks": ranks, "misses": store.report()["misses"]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
