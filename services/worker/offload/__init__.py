"""Expert offload (docs/ARCHITECTURE.md §3), in four rooms:

* stores/: the `ExpertStore` protocol and its stores (all-resident, offloading, device-driven, expert-parallel),
  and how boot builds one;
* slot_cache/: which expert lives in which GPU slot: the replacement policies, their device-side twin, statistics;
* host_memory/: the host banks the misses are copied from, their pages, and the staging ring a prefill streams
  through;
* host_compute/: the host computing missed experts where they lie (prefill and decode shares, the C kernel's
  binding, the hand-off, auto's guard) and the backend objects that wire it at boot."""
