"""Expert offload (docs/ARCHITECTURE.md §3): host banks, the slot policy, the offloading expert store, statistics."""
