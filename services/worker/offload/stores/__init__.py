"""Expert stores: where a MoE layer's routed experts are computed (docs/ARCHITECTURE.md §3).

* expert_store.py: the `ExpertStore` protocol models call, and `is_long_context`;
* resident.py: `ResidentExperts`, every expert in its own slot, nothing copied;
* offloaded.py: `OffloadedExperts`, fewer slots than experts, the host policy deciding, misses copied from host banks;
* device_driven.py: `DeviceDrivenExperts`, the offloading store with its cache on the device, graph-safe
  (what `ferry serve` runs on CUDA);
* expert_parallel.py: `ExpertParallelExperts`, experts partitioned across the ranks of a torch.distributed group;
* build.py: how boot builds the store from the plan (banks, policy, store)."""
