"""Expert offload (DESIGN §3): host banks, the slot policy, the offloading expert store, statistics."""
