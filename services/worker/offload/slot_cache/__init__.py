"""The GPU slot cache: which expert lives in which device slot, shared by all MoE layers.

* policy.py: `ExpertSlotPolicy`, the host's bookkeeping and LRU (the device cache's reference twin);
* frequency_policy.py: `LFUExpertPolicy`, the default;
* device_cache.py: `DeviceExpertCache`, the same decisions in GPU memory (kernels/expert_cache_lookup.py);
* stats.py: `ExpertCacheStats`, hits, misses, bytes and copy times per step and cumulative."""
